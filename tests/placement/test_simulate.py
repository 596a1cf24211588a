"""The scheduler's simulation (timeslice.advise.simulate), sans-IO: each figure checked against
what the scheduler's rule gives by hand for fixed phase lengths."""
from __future__ import annotations

import pytest

from timeslice.advise.simulate import SimGroup, SimJob, simulate
from timeslice.common.intervals import duty, union_length

H = 0.005     # handoff and op costs used throughout


def job(name, hold, gap, nbytes=40, snap=0.02, restore=0.03):
    return SimJob(name, (hold,), (gap,), snap, restore, nbytes)


def test_union_and_windowed_duty():
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert duty([(0, 1), (2, 3)], 0.5, 2.5) == pytest.approx(1.0 / 2.0)
    assert duty([(0, 1)], 2, 2) == 0.0


def test_a_job_alone_never_swaps_and_is_not_slowed():
    r = simulate([job("a", 0.2, 0.3)], SimGroup(64, H, H))
    assert r.swaps == 0 and r.elided == 0
    assert r.duty == pytest.approx(0.2 / (0.2 + 0.3 + H), rel=1e-3)
    assert r.jobs["a"].slowdown == pytest.approx(0.0, abs=1e-6)


def test_jobs_that_fit_together_hand_over_without_moving_anything():
    r = simulate([job("a", 0.2, 0.3), job("b", 0.2, 0.3)], SimGroup(100, H, H))
    assert r.swaps == 0 and r.elided > 0
    assert r.duty == pytest.approx(2 * 0.2 / (0.2 + 0.3 + H), rel=1e-2)


def test_jobs_that_do_not_fit_pay_a_snapshot_and_a_restore_per_turn():
    a, b = job("a", 0.2, 0.3), job("b", 0.2, 0.3)
    r = simulate([a, b], SimGroup(64, H, H))
    turn = a.snapshot_s + H + b.restore_s + H + H           # park the other, restore me, grant
    assert r.jobs["a"].mean_wait_s == pytest.approx(turn, rel=1e-3)
    step = 0.2 + 0.3 + turn
    assert r.jobs["a"].slowdown == pytest.approx(step / (0.5 + H) - 1, rel=1e-3)
    assert r.duty == pytest.approx(2 * 0.2 / step, rel=1e-2) and r.elided == 0


def test_an_overloaded_group_is_busy_but_slows_its_jobs():
    r = simulate([job("a", 0.6, 0.3, 10), job("b", 0.6, 0.3, 10)], SimGroup(100, H, H))
    assert r.duty > 0.98
    assert r.jobs["a"].slowdown > 0.3 and r.jobs["b"].slowdown > 0.3   # each waits ~0.3 s more per step


def test_fifo_turns_alternate_between_waiting_jobs():
    r = simulate([job("a", 0.5, 0.01, 10), job("b", 0.5, 0.01, 10)], SimGroup(100, H, H), horizon_s=5)
    order = [n for _, _, n in r.holds]
    assert all(x != y for x, y in zip(order, order[1:], strict=False))    # a, b, a, b, ...


def test_draws_are_seeded():
    jobs = [SimJob("a", (0.1, 0.3), (0.2, 0.4), 0.01, 0.01, 40), SimJob("b", (0.2,), (0.1, 0.5), 0.01, 0.01, 40)]
    one, again = simulate(jobs, SimGroup(64), seed=3), simulate(jobs, SimGroup(64), seed=3)
    other = simulate(jobs, SimGroup(64), seed=4)
    assert one.holds == again.holds and one.holds != other.holds


def test_bad_jobs_are_refused():
    with pytest.raises(ValueError, match="hold"):
        SimJob("a", (), (1.0,))
    with pytest.raises(ValueError, match="distinct"):
        simulate([job("a", 1, 1), job("a", 1, 1)], SimGroup())
