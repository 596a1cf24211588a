"""The simulated device and its backend, against real worker processes."""
from __future__ import annotations

import hashlib
import os
import time

import pytest
from simhelpers import MiB, wait_until

from timeslice.common import device_errors as e
from timeslice.common.sim.device import DEVICE_ID
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.sim.worker import pattern


def test_round_trip_keeps_the_bytes_and_really_frees_the_device(sim, spawn):
    w = spawn(8 * MiB, seed=7)
    assert w.expected == hashlib.sha256(pattern(7, 8 * MiB)).hexdigest()
    assert sim.get_state(w.pid) is ProcState.RUNNING
    assert sim.device_usage(w.pid) == {DEVICE_ID: 8 * MiB}
    assert wait_until(lambda: w.steps() > 5)

    snap = snapshot_processes(sim, [w.pid], lock_timeout_ms=2000)
    assert snap.ok and snap.by_pid()[w.pid].outcome is Outcome.DONE, snap
    assert snap.bytes == 8 * MiB
    assert sim.get_state(w.pid) is ProcState.CHECKPOINTED
    # The device memory is really gone: ledger, arena file, free capacity.
    assert sim.device_usage(w.pid) == {}
    assert os.path.getsize(sim.dev.arena(w.pid)) == 0
    assert sim.device_free() == {DEVICE_ID: 64 * MiB}
    assert sim.snapshot_usage(w.pid) == {DEVICE_ID: 8 * MiB}
    assert os.path.getsize(sim.dev.host_copy(w.pid)) == 8 * MiB

    # While checkpointed the worker's device operations block: no progress.
    s0 = w.steps()
    time.sleep(0.2)
    assert w.steps() == s0

    rest = restore_processes(sim, [w.pid])
    assert rest.ok and rest.by_pid()[w.pid].outcome is Outcome.DONE, rest
    assert rest.bytes == 8 * MiB
    assert sim.get_state(w.pid) is ProcState.RUNNING
    assert not sim.dev.host_copy(w.pid).exists()
    assert w.ask("verify") == f"VERIFY OK {w.expected}"
    assert wait_until(lambda: w.steps() > s0 + 5)


def test_capacity_is_enforced_across_processes(sim, spawn):
    a = spawn(40 * MiB, seed=1)
    b = spawn(40 * MiB, seed=2, ready=False)
    with pytest.raises(EOFError, match="do not fit"):
        b.read()
    assert b.proc.returncode != 0

    # Snapshotting A returns its capacity: now a second 40 MiB worker fits...
    assert snapshot_processes(sim, [a.pid], lock_timeout_ms=2000).ok
    c = spawn(40 * MiB, seed=3)
    # ...and A cannot come back while C holds it: refused up front, untouched, not lost.
    res = restore_processes(sim, [a.pid])
    assert res.refused and res.by_pid()[a.pid].error_code == "RESOURCE_EXHAUSTED"
    assert "restore refused" in res.error
    assert sim.get_state(a.pid) is ProcState.CHECKPOINTED
    c.stop()
    assert restore_processes(sim, [a.pid]).ok
    assert a.ask("verify") == f"VERIFY OK {a.expected}"


def test_unadmitted_restore_without_room_loses_the_context_like_the_driver(sim, spawn):
    """Why restores are admitted: the raw backend, like the H200 driver, loses the job."""
    a = spawn(40 * MiB, seed=1)
    assert snapshot_processes(sim, [a.pid], lock_timeout_ms=2000).ok
    c = spawn(40 * MiB, seed=3)
    with pytest.raises(e.DeviceOutOfMemory):
        sim.restore(a.pid)
    assert sim.get_state(a.pid) is ProcState.CHECKPOINTED
    c.stop()
    with pytest.raises(e.ContextLost) as lost:
        sim.restore(a.pid)
    assert lost.value.cu_result == 304


def test_agent_restart_never_forgets_a_snapshot(sim, spawn, sim_dir, tmp_path):
    w = spawn(4 * MiB, seed=11)
    assert snapshot_processes(sim, [w.pid], lock_timeout_ms=2000).ok
    fresh = SimBackend(sim_dir, tmp_path / "host", checkpoint_gbps=0, restore_gbps=0)
    assert fresh.get_state(w.pid) is ProcState.CHECKPOINTED
    assert fresh.snapshot_bytes(w.pid) == 4 * MiB
    assert restore_processes(fresh, [w.pid]).ok
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_corrupted_host_copy_is_detected_and_kept(sim, spawn):
    w = spawn(4 * MiB, seed=5)
    assert snapshot_processes(sim, [w.pid], lock_timeout_ms=2000).ok
    with open(sim.dev.host_copy(w.pid), "r+b") as f:
        f.seek(12345)
        f.write(b"\xff\x00\xff")
    res = restore_processes(sim, [w.pid])
    r = res.by_pid()[w.pid]
    assert r.outcome is Outcome.FAILED and r.error_code == "DATA_LOSS" and "sha256" in r.error
    assert sim.get_state(w.pid) is ProcState.CHECKPOINTED
    assert sim.dev.host_copy(w.pid).exists()
    assert sim.device_usage(w.pid) == {}  # the reserved device bytes were given back


def test_gone_process_is_reported_gone_and_its_memory_reclaimed(sim, spawn):
    w = spawn(4 * MiB)
    assert snapshot_processes(sim, [w.pid], lock_timeout_ms=2000).ok
    w.kill()
    assert sim.get_state(w.pid) is ProcState.GONE
    assert not sim.dev.host_copy(w.pid).exists()  # the job is gone: its host copy goes too
    res = restore_processes(sim, [w.pid])
    assert res.ok and res.all_gone
    snap = snapshot_processes(sim, [w.pid], lock_timeout_ms=2000)
    assert snap.ok and snap.by_pid()[w.pid].outcome is Outcome.GONE
    with pytest.raises(e.ProcessGone):
        sim.lock(w.pid, 100)


def test_running_dead_worker_capacity_returns_to_the_ledger(sim, spawn):
    a = spawn(40 * MiB, seed=1)
    a.kill()
    b = spawn(40 * MiB, seed=2)  # fits only because a's 40 MiB were reclaimed
    assert sim.device_usage(b.pid) == {DEVICE_ID: 40 * MiB}


def test_get_state_during_a_slow_restore_does_not_free_the_device(sim_dir, tmp_path, spawn):
    """Regression (found by the chaos suite): the crash-repair in get_state ran without the
    device lock and wiped the arena of a restore in progress."""
    import threading

    slow = SimBackend(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, checkpoint_gbps=0, restore_gbps=0.04)
    w = spawn(4 * MiB, seed=5)
    assert snapshot_processes(slow, [w.pid], lock_timeout_ms=2000).ok
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", restore_processes(slow, [w.pid])))
    t.start()
    time.sleep(0.05)
    for _ in range(20):                       # the agent's upkeep polls state meanwhile
        slow.get_state(w.pid)
        time.sleep(0.002)
    t.join(30)
    assert result["r"].ok
    assert os.path.getsize(slow.dev.arena(w.pid)) == 4 * MiB
    assert slow.device_usage(w.pid) == {DEVICE_ID: 4 * MiB}
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_a_failed_checkpoint_leaves_no_half_written_host_copy(sim, sim_dir):
    """A cooperative worker's memory is not one arena the simulator could copy (its holding is its
    context arena plus its regions): taken for a checkpoint process, the copy runs short. The device
    must keep the bytes and no ``host-<pid>.partial`` may be left behind."""
    from timeslice.sim.coop import SimCooperativeMemory
    mem = SimCooperativeMemory({"weights": (3 * MiB, "offload")}, sim_dir, gbps=0)
    pid = os.getpid()
    try:
        sim.lock(pid, 2000)
        with pytest.raises(e.SnapshotCorrupted, match="ended after"):
            sim.checkpoint(pid)
        left = list(sim.dev.host_dir.glob("*.partial"))
        assert sim.dev.held(pid) == 4 * MiB and sim.get_state(pid) is ProcState.LOCKED
    finally:
        if sim.get_state(pid) is ProcState.LOCKED:
            sim.unlock(pid)                  # else the memory's own device calls wait on the lock
    try:
        assert not left
        assert mem.checksum("weights") == mem.expected("weights")
    finally:
        mem.close()
