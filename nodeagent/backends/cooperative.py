"""The cooperative swapper: ask a job's own process, over its channel, to pause or resume.

The agent's ops run in worker threads; the channel lives on the agent's event
loop. Each call is handed to the loop (``run_coroutine_threadsafe``) and waited
for with the request's deadline. A worker that does not answer in time is a
failed swap (``SwapTimeout``): the agent does not know what it released, so the
worker's own word, when it comes, is what ``state`` reports from then on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence

from timeslice.nodeagent.backends import errors as e
from timeslice.nodeagent.backends.swapper import Swapper, SwapRefused, SwapReport, SwapState, SwapTimeout
from timeslice.nodeagent.channel import ChannelServer


class ChannelClosed(e.BackendError):
    """The worker registered as cooperative but has no open channel to this agent (yet)."""

    code = "UNAVAILABLE"


class CooperativeSwapper(Swapper):
    kind = "cooperative"

    def __init__(self, server: ChannelServer, pid: int, job: str):
        self.server, self.pid, self.job = server, pid, job

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

    def tags(self) -> dict[str, str]:
        info = self._info()
        return dict(info.tags) if info else {}

    def device(self) -> str:
        info = self._info()
        return info.device if info else ""

    def host_bytes(self) -> int:
        info = self._info()
        return info.host_bytes if info else 0

    def _call(self, msg: dict, deadline_s: float) -> dict:
        conn = self.server.conn(self.pid)
        if conn is None or conn.info.job != self.job or self.server.loop is None:
            raise ChannelClosed(f"pid {self.pid} of job {self.job!r} is registered as cooperative but has no "
                                "open channel to this agent; nothing was touched", pid=self.pid)
        fut = asyncio.run_coroutine_threadsafe(conn.call(msg, deadline_s), self.server.loop)
        try:
            reply = fut.result(deadline_s + 1.0)
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError):
            fut.cancel()
            raise SwapTimeout(f"pid {self.pid} did not answer {msg['type']} within {deadline_s:.1f} s",
                              pid=self.pid) from None
        except ConnectionError as exc:
            raise ChannelClosed(f"pid {self.pid}: channel closed during {msg['type']}: {exc}", pid=self.pid) from None
        if not reply.get("ok"):
            raise SwapRefused(f"pid {self.pid} could not {msg['type']}: {str(reply.get('error', ''))[:500]}",
                              pid=self.pid)
        return reply

    def _report(self, reply: dict, t0: float) -> SwapReport:
        return SwapReport(bytes_moved=int(reply.get("bytes_moved", 0)), device_bytes=int(reply.get("device_bytes", 0)),
                          elapsed_ms=(time.monotonic() - t0) * 1000, tags=list(reply.get("tags", [])),
                          detail={"worker_ms": reply.get("elapsed_ms", 0.0),
                                  # copies, clean pauses, wrong clean claims caught (timeslice.backup)
                                  "backup": reply.get("backup") if isinstance(reply.get("backup"), dict) else {}})

    def pause(self, tags: Sequence[str] | None, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        return self._report(self._call({"type": "pause", "tags": None if tags is None else list(tags)},
                                       deadline_s), t0)

    def resume(self, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        return self._report(self._call({"type": "resume"}, deadline_s), t0)
