"""A private event loop on a daemon thread, and the blocking call into it: how the sync face works.

``LoopThread.call(coro)`` runs ``coro`` on the loop and blocks the calling
thread until it is done, meanwhile running on the calling thread whatever the
coroutine hands it (hooks, blocking library code: usercode.py's
``CallerThread``). If the caller is interrupted (KeyboardInterrupt, or any
exception raised in its thread), the coroutine is cancelled and given a moment
to wind down, exactly as a cancelled task of the async client would be: an
acquire in flight cancels its call, and lockd gives up the job's place.

The loop belongs to the process that started it: in a child after fork() the
thread does not exist, and ``call`` raises ``ClientForkedError`` instead of
hanging.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from timeslice import errors as E
from timeslice.usercode import CALLER, CallerThread

T = TypeVar("T")
_WAKE = 0.5          # s; how often a waiting caller checks that the loop thread still runs
_WIND_DOWN = 2.0     # s; how long an interrupted caller lets its cancelled coroutine finish


async def _as_caller(caller: CallerThread, coro: Coroutine[Any, Any, Any]) -> None:
    CALLER.set(caller)            # this task (and what it starts) hands user code to the caller
    try:
        value = await coro
    except Exception as e:
        caller.finish((False, e))
    except BaseException:
        caller.finish(None)       # cancelled
        raise
    else:
        caller.finish((True, value))


class LoopThread:
    """One event loop, run by one daemon thread, started on first use."""

    def __init__(self, name: str):
        self.name = name
        self.pid = os.getpid()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self.stopped = False

    def forked(self) -> bool:
        return os.getpid() != self.pid

    def started(self) -> bool:
        return self._thread is not None

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._mu:
            if self.stopped:
                raise E.ClientClosedError("the client is closed")
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run, args=(self.loop,), name=self.name, daemon=True)
                self._thread.start()
            return self.loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    def in_loop_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop; block until it is done; return its result or raise its error."""
        if self.forked():
            coro.close()
            raise E.ClientForkedError(f"this client was made in process {self.pid}, not in this one "
                                      f"({os.getpid()})")
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("a sync OrchestratorClient was called from its own event loop thread; "
                               "from asyncio code use AsyncOrchestratorClient")
        try:
            loop = self._start()
        except BaseException:
            coro.close()
            raise
        caller = CallerThread()
        cf = asyncio.run_coroutine_threadsafe(_as_caller(caller, coro), loop)
        try:
            while caller.serve_one(_WAKE):
                if not self._alive():
                    raise E.ClientClosedError("the client was closed while the call ran")
        except BaseException:
            cf.cancel()                   # the task sees CancelledError where it waits
            self._wind_down(caller)
            raise
        if caller.outcome is None:
            raise E.ClientClosedError("the client was closed while the call ran")
        ok, value = caller.outcome
        if ok:
            return value
        raise value

    def _alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def _wind_down(self, caller: CallerThread) -> None:
        """Serve the cancelled coroutine (its finally blocks may still need this thread) for a moment."""
        loop = self.loop
        deadline = None if loop is None else loop.time() + _WIND_DOWN
        try:
            while deadline is not None and loop is not None and loop.time() < deadline and self._alive():
                if not caller.serve_one(0.05):
                    return
        finally:
            caller.abandon()

    def stop(self, budget: float = 2.0) -> None:
        """Cancel what still runs on the loop (calls of other threads then raise ClientClosedError),
        stop it and join its thread. Idempotent."""
        with self._mu:
            if self.stopped:
                return
            self.stopped = True
            loop, thread = self.loop, self._thread
        if loop is None or thread is None or self.forked():
            return
        if threading.current_thread() is thread:
            loop.stop()                   # from the loop itself: the thread ends after this callback
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=budget)
            await loop.shutdown_asyncgens()

        with contextlib.suppress(Exception):      # best effort: the thread is a daemon
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=budget + 1)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=budget)
        if not thread.is_alive():
            loop.close()
