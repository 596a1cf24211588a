"""Sending one call: a grpc.aio channel per target, re-sent per retry.py; and where user code runs.

``Transport._invoke`` is the one driver of retry.py's rules: it sends an
attempt, feeds a failed status to ``ClientCore.react`` and does what it says
(re-send after tenacity's jittered backoff, fail over, verify the session,
succeed, raise). Every call of both faces goes through it.

User code (hooks, callbacks) and blocking library code (the cooperative
channel, pinning, torch's cache release) never run on the event loop that keeps
the session alive, except an async client's own plain hooks (its user chose
the loop). Where they run:

* during a call of the sync face: on the thread that made the call (as a plain
  synchronous client would), through ``CallerThread``;
* otherwise (the keepalive noticed something, or the async face): user
  callbacks on the loop for the async face, on a worker thread for the sync
  face; blocking library code on a worker thread.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import queue
from collections.abc import Callable
from typing import Any

import grpc
import tenacity

from timeslice import errors as E
from timeslice.auth import metadata_for
from timeslice.config import CHANNEL_OPTIONS
from timeslice.core import ClientCore, Session
from timeslice.logs import get_logger
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.retry import (
    Action,
    Call,
    CallState,
    TryAgain,
    attempt_timeout,
    retry_on_try_again,
)

log = get_logger(__name__)
#: Returned by an attempt that left its replica (failover) and must be re-sent.
MOVED = object()


class CallerThread:
    """Lets a coroutine on the loop run a function on the thread that waits for the coroutine.

    The waiting thread calls ``serve_one`` until it returns False, then reads ``outcome``;
    the coroutine calls ``await run(fn, ...)``, and its wrapper ``finish(outcome)`` at the end.
    The outcome travels through the same queue, so the waiting thread wakes once per call.
    """

    _DONE = object()

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        #: (True, result) or (False, exception); None: the coroutine was cancelled.
        self.outcome: tuple[bool, Any] | None = None

    async def run(self, fn: Callable, *args: Any) -> Any:
        if self.abandoned:
            raise asyncio.CancelledError()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((fn, args, fut, loop))
        return await fut

    def finish(self, outcome: tuple[bool, Any] | None) -> None:
        self.outcome = outcome
        self._q.put(self._DONE)

    def serve_one(self, timeout: float) -> bool:
        """Run one queued function (or wait ``timeout`` s for one); False once the coroutine finished."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return True
        if item is self._DONE:
            return False
        fn, args, fut, loop = item
        try:
            ok, value = True, fn(*args)
        except Exception as e:
            ok, value = False, e
        loop.call_soon_threadsafe(_settle, fut, ok, value)
        return True

    def abandon(self) -> None:
        """The waiting thread leaves: what the coroutine asks of it from now on is cancelled."""
        self.abandoned = True
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not self._DONE:
                item[3].call_soon_threadsafe(item[2].cancel)


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():                                   # the coroutine was cancelled meanwhile
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


#: The CallerThread of the sync-face call a task serves, if any (inherited by its sub-tasks).
CALLER: contextvars.ContextVar[CallerThread | None] = contextvars.ContextVar("timeslice_caller", default=None)


class Transport(ClientCore):
    """Channels, the call driver, and where user code runs."""

    is_async = True
    #: The sync face sets this: callbacks that no call waits for run on a worker thread.
    _threaded_callbacks = False

    def _init_transport(self) -> None:
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pbg.LockdStub] = {}

    def _stub(self, idx: int) -> pbg.LockdStub:
        stub = self._stubs.get(idx)
        if stub is None:
            t = self.config.targets[idx]
            # Made on first use, inside the running loop: a grpc.aio channel belongs to one loop.
            ch = (grpc.aio.secure_channel(t, self._credentials, options=CHANNEL_OPTIONS) if self._credentials
                  else grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS))
            self._channels[idx], stub = ch, pbg.LockdStub(ch)
            self._stubs[idx] = stub
        return stub

    async def _close_channels(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for ch in channels:
            await ch.close()

    async def _verify_session(self) -> None:
        raise NotImplementedError                    # session.py

    async def _invoke(self, call: Call, build: Callable[[], Any], *, deadline: float | None,
                      cap: float | None = None, attempt: Callable | None = None, st: CallState | None = None):
        """Send ``build()`` as ``call``, re-sending per retry.py until ``deadline`` (monotonic).

        ``cap``: deadline of one attempt (default: the policy's; 0: none, for calls that block
        by design). ``attempt(stub, idx, request, timeout)``: a coroutine that sends one attempt
        itself (streams, acquire); it returns ``MOVED`` to be re-sent elsewhere."""
        st = st or CallState(call)
        cap = self.config.retry.attempt_timeout if cap is None else cap
        session = self._session

        async def once():
            self._check_usable(call)
            idx = self._cur
            stub = self._stub(idx)
            t = attempt_timeout(deadline, cap if cap > 0 else None)
            try:
                if attempt is not None:
                    got = await attempt(stub, idx, build(), t)
                    if got is MOVED:
                        raise TryAgain("UNAVAILABLE", "moved to another replica")
                    return got
                return await getattr(stub, call.method)(build(), timeout=t, metadata=metadata_for(call.method))
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                out = self.react(st, idx, code, e.details() or "")
                if out is Action.VERIFY_SESSION:
                    await self._verify_session()
                    raise TryAgain(code, e.details() or "") from None
                return out

        try:
            try:
                return await once()          # the common case: one attempt, no retry machinery
            except TryAgain as e:
                first: TryAgain | None = e

            async def again():
                nonlocal first
                if first is not None:        # tenacity counts the failed first attempt, then waits
                    e, first = first, None
                    raise e
                return await once()
            retrying = tenacity.AsyncRetrying(wait=self.config.retry.wait(), stop=self.config.retry.stop(deadline),
                                              retry=retry_on_try_again(), reraise=True)
            return await retrying(again)
        except TryAgain as last:
            err = self.exhausted(st, last)
        except E.TimesliceClientError as e:
            err = e
        await self._note_loss(call, err, session)
        raise err

    async def _note_loss(self, call: Call, err: E.TimesliceClientError, session: Session | None) -> None:
        lost = self._loss_from(call, err)
        if lost is not None:
            await self._fire(self._take_loss(lost, session), lost, "on_session_lost")

    # -- where user code runs -------------------------------------------------------
    async def _fire(self, cb: Callable | None, err: E.TimesliceClientError, name: str) -> None:
        """Tell the user through callback ``cb``; its failure is logged, never raised."""
        if cb is None:
            return
        try:
            await self._user(cb, err, name=name)
        except Exception:
            log.exception("callback_failed", job=self.job_id, callback=name)

    async def _user(self, fn: Callable, *args: Any, name: str = "hook") -> Any:
        """Run a user hook or callback where this module's doc says; its exception propagates."""
        caller = CALLER.get()
        if caller is None and not self._threaded_callbacks:
            res = fn(*args)                             # the async face: on the loop, awaited if async
            return await res if inspect.isawaitable(res) else res
        res = await (caller.run(fn, *args) if caller is not None else asyncio.to_thread(fn, *args))
        if inspect.iscoroutine(res):
            res.close()
            log.warning("callback_is_async", job=self.job_id, callback=name,
                        hint="use AsyncOrchestratorClient for async hooks and callbacks")
        return res

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        """Run blocking library code off the loop: on the sync caller's thread, else a worker thread."""
        caller = CALLER.get()
        if caller is not None:
            return await caller.run(fn, *args)
        return await asyncio.to_thread(fn, *args)
