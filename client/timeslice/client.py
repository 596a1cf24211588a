"""The synchronous client: ``OrchestratorClient`` (alias ``TimeSliceOrchestratorClient``).

    from timeslice import OrchestratorClient
    orchestrator = OrchestratorClient(target="lockd:50051", job_id="job-1")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train(batch): ...

A thin face: every method runs the same method of ``AsyncOrchestratorClient``
(aio.py, the one implementation) on a private event loop that a daemon thread
runs (bridge.py), and blocks the calling thread until it is done. So a rule of
the client (retries, failover, session loss, withdrawal, revoked groups) lives
in one place, and both faces behave alike. What the face adds is where things
run:

* The loop thread starts at the first call that needs lockd (a client can be
  made at import time, before lockd is up); ``close()`` stops it, and so does
  interpreter exit for a client not closed.
* ``after_acquire`` / ``before_yield``, torch's cache release before a yield,
  and ``cooperate()``'s blocking steps (connect, prepin) run on the thread that
  called acquire/yield_/cooperate, as in any plain synchronous client.
  ``on_session_lost`` / ``on_grant_revoked`` run on the calling thread when a
  call noticed, on a worker thread when the keepalive did; never on the loop
  thread, so a callback may call the client (``reset_session()``, ``status()``).
* A caller interrupted in a blocking call (Ctrl-C) cancels it as a cancelled
  asyncio task would: an acquire in flight gives up the job's place in the queue.
* The client belongs to the process that made it: used in a child after
  ``fork()`` it raises ``ClientForkedError`` (make a new client in the child);
  closing it there touches nothing of the parent's session.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from timeslice import errors as E
from timeslice.aio import AsyncOrchestratorClient
from timeslice.bridge import LoopThread
from timeslice.config import DEFAULT_TIMEOUT, DEFAULT_TTL, ClientConfig
from timeslice.model import Grant, GroupStatus
from timeslice.retry import RetryPolicy
from timeslice.scope import AcceleratorScope

P = ParamSpec("P")
R = TypeVar("R")
_END = object()


def _bridged(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Callable[Concatenate[Any, P], R]:
    """The blocking form of AsyncOrchestratorClient's method ``fn`` (same signature and doc)."""
    name = fn.__name__

    @functools.wraps(fn)
    def method(self: OrchestratorClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._loop.call(getattr(self._aio, name)(*args, **kwargs))
    return method


def _close_at_exit(aio_ref: weakref.ref, loop: LoopThread) -> None:
    aio = aio_ref()
    with contextlib.suppress(Exception):          # at interpreter exit: the lease expires anyway
        if aio is not None and loop.started() and not loop.forked():
            loop.call(aio.close(2.0))
        loop.stop()


class OrchestratorClient:
    """Acquire and yield GPU groups on behalf of one job (see the module doc)."""

    is_async = False

    def __init__(self, target: str | Sequence[str] | None = None, job_id: str | None = None, *,
                 session_ttl: int = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None = None,
                 release_cache: bool = True, before_yield: Callable[[Grant], Any] | None = None,
                 after_acquire: Callable[[Grant], Any] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: RetryPolicy | None = None,
                 on_grant_revoked: Callable[[E.GroupRevokedError], Any] | None = None):
        self._aio = AsyncOrchestratorClient(
            target, job_id, session_ttl=session_ttl, timeout=timeout, on_session_lost=on_session_lost,
            release_cache=release_cache, before_yield=before_yield, after_acquire=after_acquire,
            credentials=credentials, retry=retry, on_grant_revoked=on_grant_revoked)
        self._aio._callbacks_off_loop()             # never on the loop thread: see the module doc
        self._loop = LoopThread(f"timeslice-client-{self._aio.job_id}")
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self._aio), self._loop)
        atexit.register(self._atexit)

    __init__.__doc__ = AsyncOrchestratorClient.__init__.__doc__

    # == state (read on the calling thread; no I/O) =====================================
    @property
    def config(self) -> ClientConfig:
        return self._aio.config

    @property
    def job_id(self) -> str:
        return self._aio.job_id

    @property
    def targets(self) -> tuple[str, ...]:
        return self._aio.targets

    @property
    def target(self) -> str:
        """The lockd address calls go to now."""
        return self._aio.target

    @property
    def session_lost(self) -> bool:
        """True once the session was lost, until ``reset_session()``."""
        return self._aio.session_lost

    @property
    def lease_id(self) -> int | None:
        """The session's etcd lease id, once opened."""
        return self._aio.lease_id

    @property
    def held(self) -> dict[str, Grant]:
        """Groups this client holds now (by its own acquire/yield calls), with their grants."""
        return self._aio.held

    @property
    def closed(self) -> bool:
        return self._aio.closed

    # The hooks and the cache setting may be changed after construction.
    @property
    def release_cache(self) -> bool:
        return self._aio.release_cache

    @release_cache.setter
    def release_cache(self, value: bool) -> None:
        self._aio.release_cache = value

    @property
    def before_yield(self) -> Callable[[Grant], Any] | None:
        return self._aio.before_yield

    @before_yield.setter
    def before_yield(self, hook: Callable[[Grant], Any] | None) -> None:
        self._aio.before_yield = hook

    @property
    def after_acquire(self) -> Callable[[Grant], Any] | None:
        return self._aio.after_acquire

    @after_acquire.setter
    def after_acquire(self, hook: Callable[[Grant], Any] | None) -> None:
        self._aio.after_acquire = hook

    @property
    def memory_stats(self):
        return self._aio.memory_stats

    @memory_stats.setter
    def memory_stats(self, stats) -> None:
        self._aio.memory_stats = stats

    memory_stats.__doc__ = AsyncOrchestratorClient.memory_stats.__doc__

    def measured(self, group_id: str):
        return self._aio.measured(group_id)

    measured.__doc__ = AsyncOrchestratorClient.measured.__doc__

    def check_held(self, group_id: str) -> Grant:
        return self._aio.check_held(group_id)

    check_held.__doc__ = AsyncOrchestratorClient.check_held.__doc__

    def attest_worker(self, node: str):
        return self._aio.attest_worker(node)

    attest_worker.__doc__ = AsyncOrchestratorClient.attest_worker.__doc__

    # == calls (blocking forms of the async client's) ==================================
    open_session = _bridged(AsyncOrchestratorClient.open_session)
    reset_session = _bridged(AsyncOrchestratorClient.reset_session)
    acquire = _bridged(AsyncOrchestratorClient.acquire)
    yield_ = _bridged(AsyncOrchestratorClient.yield_)
    release = yield_
    register_worker = _bridged(AsyncOrchestratorClient.register_worker)
    unregister_worker = _bridged(AsyncOrchestratorClient.unregister_worker)
    cooperate = _bridged(AsyncOrchestratorClient.cooperate)
    groups = _bridged(AsyncOrchestratorClient.groups)
    status = _bridged(AsyncOrchestratorClient.status)
    create_group = _bridged(AsyncOrchestratorClient.create_group)
    delete_group = _bridged(AsyncOrchestratorClient.delete_group)
    jobs = _bridged(AsyncOrchestratorClient.jobs)
    profiles = _bridged(AsyncOrchestratorClient.profiles)

    def watch(self, group_id: str, *, timeout: float | None = None) -> Iterator[GroupStatus]:
        stream = self._aio.watch(group_id, timeout=timeout)

        async def step():
            try:
                return await stream.__anext__()
            except StopAsyncIteration:
                return _END
        try:
            while (status := self._loop.call(step())) is not _END:
                yield status
        finally:                          # the caller stopped early (or failed): end the stream
            loop = self._loop
            if loop.started() and not loop.stopped and not loop.forked() and not loop.in_loop_thread():
                with contextlib.suppress(E.TimesliceClientError):
                    self._loop.call(stream.aclose())

    watch.__doc__ = AsyncOrchestratorClient.watch.__doc__

    # == scopes ===========================================================================
    def on_accelerators(self, group_id: str, *, timeout: float | None = None,
                        device_bytes_hint: int = 0, priority: int = 0, exclusive: bool = False) -> AcceleratorScope:
        """Decorator / context manager: hold ``group_id`` while the body runs (see scope.py);
        ``priority``: the class its acquire asks for (groups with priority classes); ``exclusive``:
        the phase wants the GPUs alone (a group with sharing "fit": nobody holds beside it)."""
        return AcceleratorScope(self, group_id, timeout, device_bytes_hint, priority, exclusive)

    def _scope_enter(self, group_id: str, timeout: float | None, hint: int, priority: int = 0,
                     exclusive: bool = False) -> Grant:
        return self._loop.call(self._aio._scope_enter_async(group_id, timeout, hint, priority, exclusive))

    def _scope_exit(self, group_id: str) -> None:
        self._loop.call(self._aio._scope_exit_async(group_id))

    async def _scope_enter_async(self, group_id: str, timeout: float | None, hint: int, priority: int = 0,
                                 exclusive: bool = False) -> Grant:
        # A coroutine decorated through the sync client, run in the user's own loop: the
        # hooks run on a worker thread, as they always did for this case.
        return await asyncio.to_thread(self._scope_enter, group_id, timeout, hint, priority, exclusive)

    async def _scope_exit_async(self, group_id: str) -> None:
        await asyncio.to_thread(self._scope_exit, group_id)

    # == lifecycle ========================================================================
    def close(self, timeout: float = 5.0) -> None:
        """Close the session (its holds go with it), the channels and the loop thread. Idempotent.

        ``timeout`` bounds the CloseSession call; if lockd cannot be reached the
        lease simply expires within its TTL. In a child after fork() nothing of
        the parent's is touched: the client is only marked closed."""
        atexit.unregister(self._atexit)
        aio = self._aio
        if self._loop.forked():
            aio._mark_closed()
            self._loop.stopped = True
            return
        try:
            if self._loop.started() and not self._loop.stopped:
                self._loop.call(aio.close(timeout))
            else:
                aio._mark_closed()       # nothing was opened: no session, no channels
        finally:
            self._loop.stop()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<OrchestratorClient job={self.job_id!r} target={self.target!r} lost={self.session_lost}>"


#: The name the reference material uses; the same class.
TimeSliceOrchestratorClient = OrchestratorClient
