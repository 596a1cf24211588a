"""SIMULATOR: the simulated device's utilization (the duty-cycle metric in CI) follows its workers."""
from __future__ import annotations

from simhelpers import MiB

from timeslice.nodeagent.sim.utilization import SimUtilization


def test_idle_device_is_not_busy(sim_dir, sim, spawn):
    w = spawn(1 * MiB, step_ms=1000)          # alive, computing only briefly once a second
    assert w.steps() >= 0
    assert SimUtilization(sim_dir / "nowhere").busy() is False
    u = SimUtilization(sim_dir)
    samples = [u.busy() for _ in range(5)]
    assert samples.count(True) <= 1           # a 1-in-1000-ms step may be caught once at most


def test_a_worker_inside_a_device_operation_is_busy(sim_dir, sim, spawn):
    w = spawn(1 * MiB, step_ms=1000)
    u = SimUtilization(sim_dir)
    assert w.ask("hold 3000") == "HOLDING"    # inside a device operation for 3 s
    for t in range(5):
        u.sample(now=float(t))
    assert u.busy() is True
    assert u.fraction()["sim0"] == 1.0
    assert w.read(timeout=10) == "HELD"


def test_fraction_is_over_the_window(tmp_path):
    u = SimUtilization(tmp_path, window_s=10.0)
    u.busy = lambda: True
    for t in range(5):
        u.sample(now=float(t))
    u.busy = lambda: False
    for t in range(5, 15):
        u.sample(now=float(t))
    # At t=14 the 10 s window keeps the samples of t=4..14: one busy of eleven.
    assert [t for t, _ in u._samples] == [float(t) for t in range(4, 15)]
    assert sum(b for _, b in u._samples) == 1
