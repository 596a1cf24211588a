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
from timeslice.core import ClientCore, CoreState
from timeslice.holds import Holds, Withdrawals
from timeslice.model import Grant, GroupStatus
from timeslice.retry import RetryPolicy
from timeslice.revocations import Revocations
from timeslice.scope import Scopes
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


class AsyncOrchestratorClient(CoreState):
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
        self._transport = Transport(core, self._user, credentials)
        self._revocations = Revocations(core, self._transport, self._user)
        self._withdrawals = Withdrawals(core, self._transport)
        self._sessions = Sessions(core, self._transport, self._user, self._revocations, self._withdrawals)
        self._workers = Workers(core, self._transport, self._user, self._sessions)
        # A Yield first has the local agents report what grew inside the hold.
        self._holds = Holds(core, self._transport, self._user, self._sessions, self._withdrawals,
                            report_first=self._workers.sync_reports)
        # The one true loop: the keepalive runs the withdrawals, whose stray grant goes back through
        # the holds, whose acquires open the session. A named protocol (GrantReturn), told here.
        self._withdrawals.returns = self._holds
        self._scopes = Scopes(core, self._holds)
        self._admin = Admin(core, self._transport)

    @property
    def session_in_doubt(self) -> bool:
        """True while no keepalive has been answered for a whole TTL (lockd or etcd out of reach): the
        lease may live on in etcd, and the first answer settles it (kept, or ``session_lost``)."""
        return self._sessions.in_doubt

    # == calls ============================================================================
    open_session = _in("_sessions", Sessions.open_session)
    acquire = _in("_holds", Holds.acquire)
    yield_ = _in("_holds", Holds.yield_)
    release = yield_
    register_worker = _in("_workers", Workers.register_worker)
    unregister_worker = _in("_workers", Workers.unregister_worker)
    attest_worker = _sync_in("_workers", Workers.attest_worker)
    measured = _sync_in("_holds", Holds.measured)
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
