"""The cooperative swapper: ask a job's own process, over its channel, to pause or resume.

The agent's ops run in worker threads; the channel lives on the agent's event
loop. Each call is handed to the loop (``run_coroutine_threadsafe``) and waited
for with the request's deadline. A worker that does not answer in time is a
failed swap (``SwapTimeout``): the agent does not know what it released, so the
worker's own word, when it comes, is what ``state`` reports from then on.

A worker with no open channel (not reconnected yet after an agent restart, or
closing on its way out), or whose channel drops during the call, is waited for
(``nodeagent.reconnects``): once it is back the request goes (again: pausing
paused regions and resuming resumed ones are no-ops on the worker's side); if
it exits meanwhile its memory went with it (``ProcessGone``); past the grace,
``ChannelClosed`` with the reason.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence

from timeslice.common import device_errors as e
from timeslice.common import frames as F
from timeslice.common import swaps
from timeslice.common.server import records as R
from timeslice.nodeagent.backends.swapper import SwapEnv, Swapper, SwapRefused, SwapReport, SwapState, SwapTimeout
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.reconnects import GONE, OPEN, Reconnects


class ChannelClosed(e.BackendError):
    """The worker registered as cooperative but has no open channel to this agent (yet)."""

    code = "UNAVAILABLE"


class CooperativeSwapper(Swapper):
    kind = swaps.COOPERATIVE

    def __init__(self, server: ChannelServer, pid: int, job: str, reconnects: Reconnects | None = None):
        self.server, self.pid, self.job, self.reconnects = server, pid, job, reconnects

    @classmethod
    def for_worker(cls, env: SwapEnv, pid: int, job: str, worker: R.WorkerValue | None) -> Swapper:
        return cls(env.channel, pid, job, env.reconnects)

    def _info(self):
        info = self.server.info(self.pid)
        return info if info is not None and info.job == self.job else None

    def state(self) -> SwapState:
        info = self._info()
        if info is None:
            return SwapState.UNKNOWN
        return SwapState.PAUSED if info.paused else SwapState.RUNNING

    def paused_bytes(self) -> int | None:
        info = self._info()
        if info is None:
            return None
        return sum(info.region_bytes.get(t, 0) for t in info.paused)

    def region_bytes(self) -> dict[str, int]:
        info = self._info()
        return dict(info.region_bytes) if info else {}

    def resident_regions(self) -> dict[str, int]:
        """tag -> bytes of the regions on the device now (none paused: all of them)."""
        info = self._info()
        return {t: n for t, n in info.region_bytes.items() if t not in info.paused} if info else {}

    def tags(self) -> dict[str, str]:
        info = self._info()
        return dict(info.tags) if info else {}

    def device(self) -> str:
        info = self._info()
        return info.device if info else ""

    def host_bytes(self) -> int:
        info = self._info()
        return info.host_bytes if info else 0

    def residue_bytes(self) -> int | None:
        """What the paused worker still holds on the device outside its regions, as it measured."""
        info = self._info()
        return info.residue_bytes if info is not None and info.paused else None

    def _conn(self, what: str):
        """The open channel to the worker, waited for (bounded) if there is none now."""
        conn = self.server.conn(self.pid)
        if conn is not None and conn.info.job == self.job and self.server.loop is not None:
            return conn
        got = self.reconnects.wait_blocking(self.pid, self.job) if self.reconnects is not None else ""
        conn = self.server.conn(self.pid)
        if got == OPEN and conn is not None and conn.info.job == self.job:
            return conn
        if got == GONE:
            raise e.ProcessGone(f"{what} pid {self.pid}: the process exited without its channel", pid=self.pid)
        why = (self.reconnects.why(self.pid, self.job) if self.reconnects is not None else
               f"pid {self.pid} of job {self.job!r} is registered as cooperative but has no open channel to "
               "this agent; nothing was touched")
        raise ChannelClosed(why, pid=self.pid)

    def _call(self, msg: dict, deadline_s: float) -> dict:
        try:
            reply = self._send(self._conn(msg["type"]), msg, deadline_s)
        except ConnectionError:
            # The channel went during the call (an agent-side drop, the worker closing or dying):
            # what the worker did is in its next hello; ask again once it is back, or see it gone.
            try:
                reply = self._send(self._conn(msg["type"]), msg, deadline_s)
            except ConnectionError as exc:
                raise ChannelClosed(f"pid {self.pid}: channel closed during {msg['type']}: {exc}",
                                    pid=self.pid) from None
        if not reply.get("ok"):
            raise SwapRefused(f"pid {self.pid} could not {msg['type']}: {str(reply.get('error', ''))[:500]}",
                              pid=self.pid)
        return reply

    def _send(self, conn, msg: dict, deadline_s: float) -> dict:
        assert self.server.loop is not None            # _conn returns only an open channel
        fut = asyncio.run_coroutine_threadsafe(conn.call(msg, deadline_s), self.server.loop)
        try:
            return fut.result(deadline_s + 1.0)
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError):
            fut.cancel()
            raise SwapTimeout(f"pid {self.pid} did not answer {msg['type']} within {deadline_s:.1f} s",
                              pid=self.pid) from None

    def _report(self, reply: dict, t0: float) -> SwapReport:
        return SwapReport(bytes_moved=int(reply.get("bytes_moved", 0)), device_bytes=int(reply.get("device_bytes", 0)),
                          elapsed_ms=(time.monotonic() - t0) * 1000, tags=list(reply.get("tags", [])),
                          detail={"worker_ms": reply.get("elapsed_ms", 0.0),
                                  "residue_bytes": reply.get("residue_bytes"),
                                  # copies, clean pauses, wrong clean claims caught (timeslice.backup)
                                  "backup": reply.get("backup") if isinstance(reply.get("backup"), dict) else {}})

    def pause(self, tags: Sequence[str] | None, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        return self._report(self._call(dict(F.request(F.PAUSE, tags)), deadline_s), t0)

    def resume(self, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        return self._report(self._call(dict(F.request(F.RESUME)), deadline_s), t0)
