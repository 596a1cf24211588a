"""The asyncio client, ``AsyncOrchestratorClient``: the one implementation of the job client.

    async with AsyncOrchestratorClient(job_id="job-1") as orchestrator:
        grant = await orchestrator.acquire("trainer-group")
        ...
        await orchestrator.yield_("trainer-group")

        @orchestrator.on_accelerators(group_id="sampler-group")
        async def generate(prompts): ...

This module is the wiring room: it makes one object per concept, each taking
its collaborators in its constructor, over core.py's state and rules
(``ClientCore``, sans-IO):

* ``UserCode`` (usercode.py): where hooks, callbacks and blocking code run;
* ``Transport`` (transport.py): the channels and the call driver;
* ``Revocations`` (revocations.py): groups an admin deleted under a hold;
* ``Withdrawals`` and ``Holds`` (holds.py): taking back a failed acquire; acquire, yield;
* ``Sessions`` (session.py): open, keepalive, loss, reset;
* ``Scopes`` (scope.py): the hold count behind ``on_accelerators``;
* ``Workers`` (workers.py): worker registration, attestation, ``cooperate``;
* ``Admin`` (admin.py): groups, status, jobs, profiles, the live watch.

Each public method is its room's method (same signature and doc: ``_in``). The
sync ``OrchestratorClient`` (client.py) runs this same class on a private event loop.

Hooks and callbacks may be plain functions or coroutine functions; plain ones
run on the event loop (keep them short). Channels are created on first use,
inside the running loop; use one client per event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from timeslice import errors as E
from timeslice.admin import Admin
from timeslice.config import DEFAULT_TIMEOUT, DEFAULT_TTL, ClientConfig
from timeslice.core import ClientCore
from timeslice.holds import Holds, Withdrawals
from timeslice.model import Grant, GroupStatus
from timeslice.retry import RetryPolicy
from timeslice.revocations import Revocations
from timeslice.scope import AcceleratorScope, Scopes
from timeslice.session import Sessions
from timeslice.transport import Transport
from timeslice.usercode import UserCode
from timeslice.workers import Workers

P = ParamSpec("P")
R = TypeVar("R")


def _in(room: str, fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]
        ) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """The client's coroutine method that awaits room ``room``'s method ``fn`` (same signature and doc)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def method(self: AsyncOrchestratorClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return await getattr(getattr(self, room), name)(*args, **kwargs)
    return method


def _sync_in(room: str, fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """The client's plain method that calls room ``room``'s method ``fn`` (same signature and doc)."""
    name = fn.__name__

    @functools.wraps(fn)
    def method(self: AsyncOrchestratorClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(getattr(self, room), name)(*args, **kwargs)
    return method


class AsyncOrchestratorClient:
    """Acquire and yield GPU groups on behalf of one job, from asyncio code."""

    is_async = True

    def __init__(self, target: str | Sequence[str] | None = None, job_id: str | None = None, *,
                 session_ttl: int = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None = None,
                 release_cache: bool = True, before_yield: Callable[[Grant], Any] | None = None,
                 after_acquire: Callable[[Grant], Any] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: RetryPolicy | None = None,
                 on_grant_revoked: Callable[[E.GroupRevokedError], Any] | None = None):
        """
        target: lockd address(es): "host:port", "h1:p,h2:p", a list, or a DNS name
            (default: $TIMESLICE_TARGET, else 127.0.0.1:50051).
        job_id: this job's id (default: $TIMESLICE_JOB_ID, else $SLURM_JOB_ID, else a generated, logged one).
        session_ttl: seconds lockd keeps the job's holds after its last keepalive (3..300).
        timeout: overall deadline, failover included, of every call that does not block
            by design (acquire has its own timeout; watch runs until stopped).
        on_session_lost: called once with the SessionLostError when the session is lost.
        release_cache: before each yield, empty torch's CUDA cache if torch is loaded.
        before_yield / after_acquire: called with the Grant around each hold.
        credentials: grpc channel credentials for TLS (default: plaintext).
        retry: backoff / failover settings (timeslice.retry.RetryPolicy).
        on_grant_revoked: called with a GroupRevokedError (``.grant``) when an admin deleted
            a group this client held; learnt within a keepalive period (TTL/3).
        """
        core = ClientCore(ClientConfig.build(target, job_id, session_ttl, timeout, retry),
                          release_cache=release_cache, before_yield=before_yield, after_acquire=after_acquire,
                          on_session_lost=on_session_lost, on_grant_revoked=on_grant_revoked)
        self._core = core
        self._user = UserCode(core.job_id)
        # The transport verifies the session (an Acquire's ABORTED) through the session room,
        # made after it; the withdrawals hand a grant back through the holds, made after them.
        self._transport = Transport(core, self._user, credentials, verify_session=lambda: self._sessions.verify())
        self._revocations = Revocations(core, self._transport, self._user)
        self._withdrawals = Withdrawals(core, self._transport,
                                        release=lambda group_id, token: self._holds.release_quietly(group_id, token))
        self._sessions = Sessions(core, self._transport, self._user, self._revocations, self._withdrawals)
        # A Yield first has the local agents report what grew inside the hold (the workers, made after).
        self._holds = Holds(core, self._transport, self._user, self._sessions, self._withdrawals,
                            report_first=lambda: self._workers.sync_reports())
        self._scopes = Scopes(core, self._holds)
        self._workers = Workers(core, self._transport, self._user, self._sessions)
        self._admin = Admin(core, self._transport)

    # == state (no I/O) ===================================================================
    @property
    def config(self) -> ClientConfig:
        return self._core.config

    @property
    def job_id(self) -> str:
        return self._core.job_id

    @property
    def targets(self) -> tuple[str, ...]:
        return self._core.config.targets

    @property
    def target(self) -> str:
        """The lockd address calls go to now."""
        return self._core.target

    @property
    def session_lost(self) -> bool:
        """True once the session was lost, until ``reset_session()``."""
        return self._core.lost is not None

    @property
    def lease_id(self) -> int | None:
        """The session's etcd lease id, once opened."""
        return self._core.lease_id

    @property
    def held(self) -> dict[str, Grant]:
        """Groups this client holds now (by its own acquire/yield calls), with their grants."""
        return self._core.grants.snapshot()

    @property
    def closed(self) -> bool:
        return self._core.closed

    # The hooks and the cache setting may be changed after construction.
    @property
    def release_cache(self) -> bool:
        return self._core.release_cache

    @release_cache.setter
    def release_cache(self, value: bool) -> None:
        self._core.release_cache = value

    @property
    def before_yield(self) -> Callable[[Grant], Any] | None:
        return self._core.before_yield

    @before_yield.setter
    def before_yield(self, hook: Callable[[Grant], Any] | None) -> None:
        self._core.before_yield = hook

    @property
    def after_acquire(self) -> Callable[[Grant], Any] | None:
        return self._core.after_acquire

    @after_acquire.setter
    def after_acquire(self, hook: Callable[[Grant], Any] | None) -> None:
        self._core.after_acquire = hook

    @property
    def memory_stats(self):
        """Where the job's device-memory figures come from (``timeslice.memstats.DeviceStats``): measured
        at each yield and sent with the next Acquire, for the footprint a grant admits. Default: the
        cooperating memory's, else torch's allocator once the job has CUDA up; settable (a JAX memory)."""
        return self._core.memory_stats

    @memory_stats.setter
    def memory_stats(self, stats) -> None:
        self._core.memory_stats = stats

    def measured(self, group_id: str):
        """The measures this client sends with its next Acquire of ``group_id`` (``memstats.Measure``)."""
        return self._holds.measured(group_id)

    check_held = _sync_in("_core", ClientCore.check_held)

    # == calls ============================================================================
    open_session = _in("_sessions", Sessions.open_session)
    acquire = _in("_holds", Holds.acquire)
    yield_ = _in("_holds", Holds.yield_)
    release = yield_
    register_worker = _in("_workers", Workers.register_worker)
    unregister_worker = _in("_workers", Workers.unregister_worker)
    attest_worker = _sync_in("_workers", Workers.attest_worker)
    cooperate = _in("_workers", Workers.cooperate)
    groups = _in("_admin", Admin.groups)
    status = _in("_admin", Admin.status)
    create_group = _in("_admin", Admin.create_group)
    delete_group = _in("_admin", Admin.delete_group)
    jobs = _in("_admin", Admin.jobs)
    profiles = _in("_admin", Admin.profiles)

    async def watch(self, group_id: str, *, timeout: float | None = None) -> AsyncGenerator[GroupStatus, None]:
        stream = self._admin.watch(group_id, timeout=timeout)
        try:
            async for status in stream:
                yield status
        finally:                          # the caller stopped early (or failed): the stream ends now
            await stream.aclose()

    watch.__doc__ = Admin.watch.__doc__

    async def reset_session(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        await self._sessions.reset()
        self._scopes.clear()
        self._withdrawals.clear()

    # == scopes ===========================================================================
    def on_accelerators(self, group_id: str, *, timeout: float | None = None,
                        device_bytes_hint: int = 0, priority: int = 0, exclusive: bool = False) -> AcceleratorScope:
        """Decorator / context manager: hold ``group_id`` while the body runs (see scope.py);
        ``priority``: the class its acquire asks for (groups with priority classes); ``exclusive``:
        the phase wants the GPUs alone (a group with sharing "fit": nobody holds beside it)."""
        return AcceleratorScope(self, group_id, timeout, device_bytes_hint, priority, exclusive)

    def _scope_enter(self, group_id: str, timeout, hint, priority: int = 0, exclusive: bool = False):
        raise TypeError("AsyncOrchestratorClient.on_accelerators is an async context manager: "
                        "use `async with`, or the sync OrchestratorClient")

    def _scope_exit(self, group_id: str):
        raise TypeError("use `async with` with AsyncOrchestratorClient")

    async def _scope_enter_async(self, group_id: str, timeout: float | None, hint: int, priority: int = 0,
                                 exclusive: bool = False) -> Grant:
        return await self._scopes.enter(group_id, timeout, hint, priority, exclusive)

    async def _scope_exit_async(self, group_id: str) -> None:
        await self._scopes.exit(group_id)

    # == lifecycle ========================================================================
    async def close(self, timeout: float = 5.0) -> None:
        """Close the session (its holds go with it) and the channels. Idempotent.

        ``timeout`` bounds the CloseSession call; if lockd cannot be reached the
        lease simply expires within its TTL."""
        core = self._core
        with core.mu:
            if core.closed or core.closing:
                return
            core.closing = True           # a deliberate close is not a session loss
            if os.getpid() != core.pid:   # a child after fork: the session and channels are the parent's
                core.closed = True
                return
        ka = self._sessions.stop_keepalive()
        if ka is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await ka
        await self._workers.close()
        await self._sessions.end(timeout)
        with core.mu:
            core.closed = True
            core.grants.clear()
        self._sessions.drop_ending()
        self._holds.close()
        await self._transport.close()

    def _mark_closed(self) -> None:
        """Closed without I/O: nothing was opened, or this is a child after fork (the sync face's)."""
        self._core.closed = True

    def _callbacks_off_loop(self) -> None:
        """Run callbacks that no call waits for on a worker thread, never on the loop (the sync face's)."""
        self._user.threaded_callbacks = True

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncOrchestratorClient job={self.job_id!r} target={self.target!r} lost={self.session_lost}>"
