"""The job-level safety rules of nodeagent.backends.ops, on the simulated device."""
from __future__ import annotations

import os
import shutil
import time

import pytest
from simhelpers import MiB, wait_until, write_meminfo
from structlog.testing import capture_logs

from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.ops import (
    Outcome,
    restore_processes,
    snapshot_processes,
)
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.nodeagent.hostmem import HostMemory


def test_snapshot_refused_when_host_memory_is_short_touches_nothing(sim, spawn, proc_root):
    w = spawn(8 * MiB)
    # 12 MiB available minus a 6 MiB reserve = 6 MiB < 8 MiB.
    write_meminfo(proc_root, available_kib=12 * 1024)
    host = HostMemory(proc_root, reserve_bytes=6 * MiB)
    with capture_logs() as logs:
        res = snapshot_processes(sim, [w.pid], lock_timeout_ms=1000, host=host)
    r = res.by_pid()[w.pid]
    assert res.refused and r.outcome is Outcome.REFUSED and r.error_code == "RESOURCE_EXHAUSTED"
    assert "needs 8388608 bytes of host memory, 6291456 free" in r.error
    assert [ev["event"] for ev in logs] == ["admission_refused"]
    assert sim.get_state(w.pid) is ProcState.RUNNING
    s0 = w.steps()
    assert wait_until(lambda: w.steps() > s0)
    # With room, the same call goes through.
    write_meminfo(proc_root, available_kib=15 * 1024)
    assert snapshot_processes(sim, [w.pid], lock_timeout_ms=1000, host=host).ok


def test_host_admission_counts_the_whole_job(sim, spawn, proc_root):
    a, b = spawn(6 * MiB, seed=1), spawn(6 * MiB, seed=2)
    write_meminfo(proc_root, available_kib=10 * 1024)   # each fits alone, not both
    res = snapshot_processes(sim, [a.pid, b.pid], lock_timeout_ms=1000, host=HostMemory(proc_root, 0))
    assert [r.outcome for r in res.results] == [Outcome.REFUSED, Outcome.REFUSED]
    assert sim.get_state(a.pid) is sim.get_state(b.pid) is ProcState.RUNNING


def test_lock_timeout_leaves_the_process_running(sim, spawn):
    w = spawn(4 * MiB)
    w.send("hold 1500")
    assert w.read() == "HOLDING"
    t0 = time.monotonic()
    res = snapshot_processes(sim, [w.pid], lock_timeout_ms=150)
    took = time.monotonic() - t0
    r = res.by_pid()[w.pid]
    assert r.outcome is Outcome.FAILED and r.error_code == "DEADLINE_EXCEEDED", r
    assert "NOT_READY" in r.error and r.state_after is ProcState.RUNNING
    assert 0.15 <= took < 1.0
    assert w.read() == "HELD"
    s0 = w.steps()
    assert wait_until(lambda: w.steps() > s0 + 3)
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_a_long_enough_lock_waits_for_in_flight_work(sim, spawn):
    w = spawn(4 * MiB)
    w.send("hold 400")
    assert w.read() == "HOLDING"
    t0 = time.monotonic()
    res = snapshot_processes(sim, [w.pid], lock_timeout_ms=5000)
    assert res.ok and time.monotonic() - t0 >= 0.3
    assert w.read() == "HELD"


def test_failed_checkpoint_unlocks_the_process(sim, spawn):
    w = spawn(4 * MiB)
    # Make the host side unwritable for real: the host dir becomes a plain file.
    shutil.rmtree(sim.dev.host_dir)
    sim.dev.host_dir.write_text("not a directory")
    with capture_logs() as logs:
        res = snapshot_processes(sim, [w.pid], lock_timeout_ms=1000)
    r = res.by_pid()[w.pid]
    assert r.outcome is Outcome.FAILED and r.state_after is ProcState.RUNNING, r
    assert "Not a directory" in r.error
    assert any(ev["event"] == "checkpoint_failed" for ev in logs)
    # Unlocked, still on the device, still computing, data intact.
    assert sim.device_usage(w.pid) == {"sim0": 4 * MiB}
    s0 = w.steps()
    assert wait_until(lambda: w.steps() > s0 + 3)
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_two_processes_are_snapshotted_in_parallel(sim_dir, tmp_path, spawn):
    # 4 MiB at 0.02 GB/s is ~0.2 s a process: in series 0.4 s, in parallel ~0.2 s.
    slow = SimBackend(sim_dir, tmp_path / "host", checkpoint_gbps=0.02, restore_gbps=0.02)
    a, b = spawn(4 * MiB, seed=1), spawn(4 * MiB, seed=2)
    snap = snapshot_processes(slow, [a.pid, b.pid], lock_timeout_ms=2000)
    assert snap.ok and snap.bytes == 8 * MiB
    each = [r.elapsed_ms for r in snap.results]
    assert min(each) >= 190
    assert snap.elapsed_ms < 0.75 * sum(each), snap
    rest = restore_processes(slow, [a.pid, b.pid])
    assert rest.ok and rest.elapsed_ms < 0.75 * sum(r.elapsed_ms for r in rest.results)
    assert a.ask("verify") == f"VERIFY OK {a.expected}"
    assert b.ask("verify") == f"VERIFY OK {b.expected}"


def test_snapshot_and_restore_are_idempotent(sim, spawn):
    w = spawn(4 * MiB)
    assert snapshot_processes(sim, [w.pid, w.pid], lock_timeout_ms=1000).by_pid()[w.pid].outcome is Outcome.DONE
    again = snapshot_processes(sim, [w.pid], lock_timeout_ms=1000)
    assert again.ok and again.by_pid()[w.pid].outcome is Outcome.ALREADY and again.bytes == 4 * MiB
    assert restore_processes(sim, [w.pid]).by_pid()[w.pid].outcome is Outcome.DONE
    back = restore_processes(sim, [w.pid])
    assert back.ok and back.by_pid()[w.pid].outcome is Outcome.ALREADY and back.bytes == 0
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_half_done_work_of_a_crashed_agent_is_finished(sim, spawn):
    w = spawn(4 * MiB)
    sim.lock(w.pid, 1000)           # an agent locked it, then died
    res = snapshot_processes(sim, [w.pid], lock_timeout_ms=1000)
    assert res.by_pid()[w.pid].outcome is Outcome.DONE
    assert res.by_pid()[w.pid].state_before is ProcState.LOCKED
    sim.restore(w.pid)              # an agent restored it, then died before unlocking
    res = restore_processes(sim, [w.pid])
    assert res.by_pid()[w.pid].outcome is Outcome.DONE and sim.get_state(w.pid) is ProcState.RUNNING
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_process_without_a_device_is_skipped_not_failed(sim):
    res = snapshot_processes(sim, [os.getpid()], lock_timeout_ms=1000)
    assert res.ok and res.by_pid()[os.getpid()].outcome is Outcome.SKIPPED


def test_mixed_job_reports_each_pid(sim, spawn):
    alive, dead = spawn(4 * MiB, seed=1), spawn(4 * MiB, seed=2)
    dead.kill()
    res = snapshot_processes(sim, [alive.pid, dead.pid], lock_timeout_ms=1000)
    assert res.ok and not res.all_gone
    assert {r.pid: r.outcome for r in res.results} == {alive.pid: Outcome.DONE, dead.pid: Outcome.GONE}


def test_lock_timeout_must_be_bounded(sim):
    with pytest.raises(ValueError):
        snapshot_processes(sim, [os.getpid()], lock_timeout_ms=0)

