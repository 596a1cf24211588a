"""Cooperative workers without an open channel: the agent waits, a bounded time, for each to come back.

A cooperative worker's memory moves only when the worker itself is asked, over
its channel (``nodeagent.channel``). Without one the agent can neither pause
nor resume it, and right after the agent's own restart it does not even know
what the worker has paused: its state is *unknown* (``records.UNKNOWN``) until
its hello says. That happens when the agent restarted and the worker has not
reconnected yet (it retries within a few seconds, ``timeslice.cooperative``),
or when the worker closed its channel, as a job does on its way out.

So an op that needs such a worker waits for it, until one of:

* it connects: its hello says what it has paused, and the op goes on with that;
* its process exits: its memory is gone with it (the op reports it gone);
* ``--reconnect-grace-s`` has passed since its channel went (since the agent
  started, for a worker this agent never heard from). The op then fails with
  ``why``, which the leader hands to the waiting job; nothing was touched.

``wait`` runs on the agent's event loop; ``wait_blocking`` is for the backend's
worker threads (a channel that drops in the middle of a pause or resume).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterable

from timeslice.common import procfs
from timeslice.nodeagent.channel import ChannelServer

OPEN, GONE, AWAY = "open", "gone", "away"
DEFAULT_RECONNECT_GRACE_S = 20.0     # a live worker retries within ~3 s; an agent on a busy host is slower
POLL_S = 0.2                         # how often a waiter looks whether the process exited


class Reconnects:
    def __init__(self, server: ChannelServer, grace_s: float = DEFAULT_RECONNECT_GRACE_S,
                 alive: Callable[[int], bool] = procfs.is_alive):
        self.server, self.grace_s, self.alive = server, grace_s, alive

    def is_open(self, pid: int, job: str) -> bool:
        conn = self.server.conn(pid)
        return conn is not None and conn.info.job == job

    def deadline(self, pid: int) -> float:
        """Until when (monotonic) an op waits for ``pid`` to (re)connect."""
        since = self.server.lost_at(pid)
        return (since if since is not None else self.server.started_at) + self.grace_s

    async def wait(self, pid: int, job: str) -> str:
        """OPEN once ``pid`` has a channel for ``job``, GONE once it exited, AWAY past its deadline."""
        while True:
            if self.is_open(pid, job):
                return OPEN
            if not self.alive(pid):
                return GONE
            left = self.deadline(pid) - time.monotonic()
            if left <= 0:
                return AWAY
            await self.server.next_hello(min(left, POLL_S))

    def wait_blocking(self, pid: int, job: str) -> str:
        """``wait`` from a thread other than the agent's event loop."""
        loop = self.server.loop
        if loop is None:
            return AWAY
        fut = asyncio.run_coroutine_threadsafe(self.wait(pid, job), loop)
        try:
            return fut.result(max(0.0, self.deadline(pid) - time.monotonic()) + 5.0)
        except (concurrent.futures.TimeoutError, TimeoutError):
            fut.cancel()                     # the loop is stuck or stopping: the worker counts as away
            return AWAY

    async def wait_all(self, pids: Iterable[int], job: str) -> str:
        """Wait for every pid of ``job`` in ``pids`` that has no open channel; the reasons of
        those still away afterwards ("" if none)."""
        away = [p for p in pids if not self.is_open(p, job)]
        got = await asyncio.gather(*(self.wait(p, job) for p in away))
        return "; ".join(self.why(p, job) for p, g in zip(away, got) if g == AWAY)

    async def settle(self, pending: Callable[[], list[int]]) -> None:
        """Return once ``pending()`` (the pids still settling: ``JobProcesses.settling``, which is
        empty once the agent has run ``grace_s``) is empty, looking again at every hello."""
        while pending():
            await self.server.next_hello(POLL_S)

    def why(self, pid: int, job: str) -> str:
        said = self.server.info(pid)
        what = ("closed its channel to this agent" if said is not None and said.job == job
                else "has not connected to this agent since it started")
        return (f"pid {pid} of job {job!r} is a cooperative worker that {what} and did not come back within "
                f"{self.grace_s:g} s (--reconnect-grace-s): its device memory can be neither moved nor "
                f"known to be back; nothing was touched")
