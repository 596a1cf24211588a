"""Freeze and thaw a job in place (strict groups) on the SIMULATED device: nothing copied,
every device operation of a frozen process waits, a thaw lets it run on intact bytes; and the
job's state as the agent reports it."""
from __future__ import annotations

import queue

from simhelpers import MiB, wait_until

from timeslice.common.server import records as R
from timeslice.nodeagent import orphans as O
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.freezing import freeze_processes, thaw_processes
from timeslice.nodeagent.backends.ops import Outcome, snapshot_processes
from timeslice.nodeagent.picture import job_state, take


def test_a_frozen_process_runs_nothing_until_thawed_and_keeps_its_bytes(sim, spawn):
    w = spawn(4 * MiB, seed=5)
    expected = w.ask("verify").split()[-1]
    held = sim.dev.held(w.pid)
    res = freeze_processes(sim, [w.pid], lock_timeout_ms=1000)
    assert res.ok and res.by_pid()[w.pid].outcome is Outcome.DONE and res.bytes == 0
    assert sim.get_state(w.pid) is ProcState.LOCKED and sim.dev.held(w.pid) == held   # nothing moved
    s0 = w.steps()
    assert not wait_until(lambda: w.steps() > s0 + 1, timeout=0.3)     # its "kernels" wait
    w.send("verify")
    try:
        w.read(timeout=0.3)
        raise AssertionError("a device operation of a frozen process ran")
    except (TimeoutError, queue.Empty):
        pass
    assert take(sim, [w.pid]).state == R.FROZEN
    # Idempotent: a second freeze is "already".
    assert freeze_processes(sim, [w.pid], lock_timeout_ms=1000).by_pid()[w.pid].outcome is Outcome.ALREADY
    res = thaw_processes(sim, [w.pid])
    assert res.ok and res.by_pid()[w.pid].outcome is Outcome.DONE
    assert w.read() == f"VERIFY OK {expected}"                         # the waiting call ran, bytes intact
    assert take(sim, [w.pid]).state == R.RUNNING
    assert thaw_processes(sim, [w.pid]).by_pid()[w.pid].outcome is Outcome.ALREADY


def test_a_frozen_process_can_still_be_snapshotted_and_gone_ones_are_no_error(sim, spawn):
    w = spawn(4 * MiB)
    assert freeze_processes(sim, [w.pid], lock_timeout_ms=1000).ok
    res = snapshot_processes(sim, [w.pid], lock_timeout_ms=1000)       # room needed later: from LOCKED
    assert res.ok and sim.get_state(w.pid) is ProcState.CHECKPOINTED
    # A parked process runs nothing either: left alone by a freeze.
    assert freeze_processes(sim, [w.pid], lock_timeout_ms=1000).by_pid()[w.pid].outcome is Outcome.SKIPPED
    w.kill()
    assert wait_until(lambda: sim.get_state(w.pid) is ProcState.GONE)
    assert freeze_processes(sim, [w.pid], lock_timeout_ms=1000).all_gone


def test_a_lock_timeout_leaves_the_process_running(sim, spawn):
    w = spawn(4 * MiB)
    w.send("hold 1500")
    assert w.read() == "HOLDING"
    r = freeze_processes(sim, [w.pid], lock_timeout_ms=100).by_pid()[w.pid]
    assert r.outcome is Outcome.FAILED and "NOT_READY" in r.error and r.state_after is ProcState.RUNNING
    assert w.read() == "HELD"


def test_job_state_frozen_only_when_every_process_on_a_device_is_locked():
    L, Ru, N, C = ProcState.LOCKED, ProcState.RUNNING, ProcState.NO_CUDA, ProcState.CHECKPOINTED
    assert job_state({1: L, 2: L}) == R.FROZEN
    assert job_state({1: L, 2: N}) == R.FROZEN            # a CPU-only process runs nothing on a GPU
    assert job_state({1: L, 2: Ru}) == R.RUNNING          # one of them could still run kernels
    assert job_state({1: L, 2: C}) == R.SNAPSHOTTED
    assert job_state({1: N}) == R.RUNNING


def test_a_job_frozen_on_purpose_is_thawed_only_when_it_leaves_deliberately():
    frozen = {"A": [1, 2], "B": [3]}
    # A unregistered pid 2 (its session lives on), B's session expired (not deliberate).
    left = O.Orphans.leaving(frozen, {1: "A"}, deliberate=lambda job: job == "A")
    assert left == {2: "A"}
    # A pid another job registered is not A's any more: A let it go.
    assert O.Orphans.leaving({"A": [1]}, {1: "X"}, deliberate=lambda job: True) == {1: "A"}
