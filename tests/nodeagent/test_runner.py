"""The runner brackets every op with the backend's ``prepare`` and ``finish`` (nodeagent/runner.py).

Both are on the ``Backend`` interface (no-ops there): a whole-process checkpoint backend runs its
ops as before, and a backend that keeps per-op context (the cooperative swaps) is told the
group's isolation and the room needed first, and always gets ``finish`` after, even when
``prepare`` itself failed. Real simulated workers, one process each.
"""
from __future__ import annotations

from collections.abc import Sequence

from simhelpers import MiB

from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.nodeagent.hostmem import HostMemory
from timeslice.nodeagent.metrics import Metrics
from timeslice.nodeagent.runner import Runner


class Bracketed(SimBackend):
    """The simulator, noting each prepare and finish with the state the process was in."""

    def __init__(self, *a, fail_prepare: bool = False, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple] = []
        self.fail_prepare = fail_prepare

    def prepare(self, op: str, pids: Sequence[int], isolation: str = "", need_bytes: int = 0) -> None:
        self.calls.append(("prepare", op, list(pids), isolation, need_bytes,
                           [self.get_state(p) for p in pids]))
        if self.fail_prepare:
            raise RuntimeError("prepare broke")

    def finish(self, pids: Sequence[int]) -> None:
        self.calls.append(("finish", list(pids), [self.get_state(p) for p in pids]))


def _runner(backend) -> Runner:
    return Runner(backend, HostMemory(reserve_bytes=0), 2_000, Metrics())


async def test_a_plain_backend_runs_through_the_default_prepare_and_finish(sim, spawn):
    w = spawn(4 * MiB)
    rr = await _runner(sim).run(R.SNAPSHOT, "j", [w.pid], "intent", isolation=R.ISOLATION_NONE, need_bytes=MiB)
    assert rr.outcome == R.OK and rr.after.states[w.pid] is ProcState.CHECKPOINTED
    rr = await _runner(sim).run(R.RESTORE, "j", [w.pid], "intent")
    assert rr.outcome == R.OK and rr.after.states[w.pid] is ProcState.RUNNING


async def test_prepare_comes_before_the_op_and_finish_after_it(sim_dir, tmp_path, spawn):
    be = Bracketed(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, checkpoint_gbps=0, restore_gbps=0)
    w = spawn(4 * MiB)
    rr = await _runner(be).run(R.SNAPSHOT, "j", [w.pid], "intent", isolation=R.ISOLATION_FULL, need_bytes=3 * MiB)
    assert rr.outcome == R.OK
    assert be.calls == [("prepare", R.SNAPSHOT, [w.pid], R.ISOLATION_FULL, 3 * MiB, [ProcState.RUNNING]),
                        ("finish", [w.pid], [ProcState.CHECKPOINTED])]


async def test_a_failed_prepare_fails_the_op_touches_nothing_and_still_finishes(sim_dir, tmp_path, spawn):
    be = Bracketed(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, checkpoint_gbps=0, restore_gbps=0,
                   fail_prepare=True)
    w = spawn(4 * MiB)
    rr = await _runner(be).run(R.SNAPSHOT, "j", [w.pid], "intent")
    assert rr.outcome == R.FAILED and "prepare broke" in rr.result.error
    assert rr.after.states[w.pid] is ProcState.RUNNING
    assert [c[0] for c in be.calls] == ["prepare", "finish"]
    assert w.ask("verify").split()[:2] == ["VERIFY", "OK"]
