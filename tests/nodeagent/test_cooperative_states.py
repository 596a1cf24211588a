"""A cooperative worker's state as the agent's backend sees it, over a real channel, in one process.

The agent's channel server runs on this test's event loop; this very process is the worker
(``CooperativeWorker`` on a pause/resume pair of its own, two regions). What is checked: a
selective pause leaves the worker PARTIAL (parked, with regions to free), a further snapshot
pauses the rest; a worker whose registration is gone is still cooperative (never handed to the
checkpoint backend); a worker with no channel is waited for, and gone or away is told apart.
"""
from __future__ import annotations

import asyncio
import os

from timeslice.common.server import records as R
from timeslice.cooperative import CooperativeWorker
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.composite import CompositeBackend
from timeslice.nodeagent.backends.cooperative import CooperativeSwapper
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.nodeagent.backends.swapper import SwapEnv
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.reconnects import AWAY, GONE, OPEN, Reconnects
from timeslice.nodeagent.swap_routes import SwapRoutes

MiB = 1 << 20


class TwoRegions:
    """The job's memory: weights (offloaded) and kv (discarded), as SwapMemory; records the calls."""

    tags = {"weights": "offload", "kv": "discard"}

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []

    def device_id(self) -> str:
        return "sim0"

    def region_bytes(self) -> dict[str, int]:
        return {"weights": 12 * MiB, "kv": 7 * MiB}

    def host_bytes(self) -> int:
        return 12 * MiB

    def pause(self, tags):
        self.calls.append(("pause", list(tags)))

    def resume(self, tags):
        self.calls.append(("resume", list(tags)))


class Unregistered:
    """The agent's view of etcd's registrations, with none for this process (its job closed)."""

    class jobs_mirror:
        revision = 0

    def local_workers(self) -> dict:
        return {}


async def _agent_side(tmp_path, grace_s: float = 5.0):
    async def anyone(job, secret):
        return None
    server = ChannelServer(tmp_path / "agent.sock", "n", anyone)
    await server.start()
    reconnects = Reconnects(server, grace_s)
    base = SimBackend(tmp_path / "sim", tmp_path / "host", capacity_bytes=64 * MiB)
    swappers = SwapRoutes(Unregistered(), SwapEnv(server, reconnects, base))
    return server, reconnects, CompositeBackend(base, swappers.resolve, deadline_s=5.0), swappers


async def test_a_selective_pause_leaves_the_worker_partial_and_a_snapshot_takes_the_rest(tmp_path):
    server, _, backend, swappers = await _agent_side(tmp_path)
    mem = TwoRegions()
    w = CooperativeWorker("j", "secret", mem, "n", str(tmp_path / "agent.sock"))
    await asyncio.to_thread(w.start)
    pid = os.getpid()
    try:
        # No registration (the job closed its session): still its own worker, never the checkpoint backend's.
        assert isinstance(swappers.resolve(pid), CooperativeSwapper) and swappers.cooperative(pid)
        assert backend.get_state(pid) is ProcState.RUNNING
        await asyncio.to_thread(backend.prepare, R.SNAPSHOT, [pid], "", 5 * MiB)   # 5 MiB needed: kv goes
        got = await asyncio.to_thread(snapshot_processes, backend, [pid])
        assert got.ok and mem.calls == [("pause", ["kv"])]
        assert backend.get_state(pid) is ProcState.PARTIAL
        backend.finish([pid])
        # Asked again (the next job needs everything): only what is still there.
        await asyncio.to_thread(backend.prepare, R.SNAPSHOT, [pid], "", 0)
        got = await asyncio.to_thread(snapshot_processes, backend, [pid])
        assert got.ok and got.by_pid()[pid].outcome is Outcome.DONE, got
        assert mem.calls[-1] == ("pause", ["weights"]) and backend.get_state(pid) is ProcState.CHECKPOINTED
        backend.finish([pid])
        got = await asyncio.to_thread(restore_processes, backend, [pid])
        assert got.ok and mem.calls[-1][0] == "resume" and sorted(mem.calls[-1][1]) == ["kv", "weights"]
        assert backend.get_state(pid) is ProcState.RUNNING
    finally:
        await asyncio.to_thread(w.close)
        await server.stop()


async def test_a_worker_without_a_channel_is_waited_for_then_told_away_or_open(tmp_path):
    server, reconnects, _, _ = await _agent_side(tmp_path, grace_s=0.5)
    pid = os.getpid()
    try:
        # Never heard from since the agent started: away once the grace has passed, with the reason.
        assert await reconnects.wait(pid, "j") == AWAY
        assert "--reconnect-grace-s" in await reconnects.wait_all([pid], "j")
        # A process that exited: gone at once (its memory went with it).
        child = await asyncio.create_subprocess_exec("true")
        await child.wait()
        assert await reconnects.wait(child.pid, "j") == GONE
        # The worker connects while an op waits for it: the op goes on at once.
        reconnects.grace_s = 30.0
        w = CooperativeWorker("j", "secret", TwoRegions(), "n", str(tmp_path / "agent.sock"))
        waiting = asyncio.create_task(reconnects.wait(pid, "j"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await asyncio.to_thread(w.start)
        assert await asyncio.wait_for(waiting, 10) == OPEN
        await asyncio.to_thread(w.close)
    finally:
        await server.stop()
