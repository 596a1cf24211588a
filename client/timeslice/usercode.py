"""Where user code and blocking library code run, so that neither stalls the session's loop.

User code (hooks, callbacks) and blocking library code (the cooperative
channel, pinning, torch's cache release) never run on the event loop that keeps
the session alive, except an async client's own plain hooks (its user chose
the loop). Where they run:

* during a call of the sync face: on the thread that made the call (as a plain
  synchronous client would), through ``CallerThread``;
* otherwise (the keepalive noticed something, or the async face): user
  callbacks on the loop for the async face, on a worker thread for the sync
  face; blocking library code on a worker thread.

``UserCode`` is the one object that decides it; every room that runs a hook,
a callback or blocking code takes it in its constructor.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import queue
from collections.abc import Callable
from typing import Any

from timeslice import errors as E
from timeslice.logs import get_logger

log = get_logger(__name__)


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


class UserCode:
    """Runs the job's hooks and callbacks, and blocking library code, where the module doc says."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        #: The sync face sets this: callbacks that no call waits for run on a worker thread.
        self.threaded_callbacks = False

    async def fire(self, cb: Callable | None, err: E.TimesliceClientError, name: str) -> None:
        """Tell the user through callback ``cb``; its failure is logged, never raised."""
        if cb is None:
            return
        try:
            await self.run(cb, err, name=name)
        except Exception:
            log.exception("callback_failed", job=self.job_id, callback=name)

    async def run(self, fn: Callable, *args: Any, name: str = "hook") -> Any:
        """Run a user hook or callback; its exception propagates."""
        caller = CALLER.get()
        if caller is None and not self.threaded_callbacks:
            res = fn(*args)                             # the async face: on the loop, awaited if async
            return await res if inspect.isawaitable(res) else res
        res = await (caller.run(fn, *args) if caller is not None else asyncio.to_thread(fn, *args))
        if inspect.iscoroutine(res):
            res.close()
            log.warning("callback_is_async", job=self.job_id, callback=name,
                        hint="use AsyncOrchestratorClient for async hooks and callbacks")
        return res

    async def blocking(self, fn: Callable, *args: Any) -> Any:
        """Run blocking library code off the loop: on the sync caller's thread, else a worker thread."""
        caller = CALLER.get()
        if caller is not None:
            return await caller.run(fn, *args)
        return await asyncio.to_thread(fn, *args)
