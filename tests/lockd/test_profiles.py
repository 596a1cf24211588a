"""Job profiles read off the history of holds (lockd/profiles.py), sans-IO."""
from __future__ import annotations

import pytest

from timeslice.common.server import records as R
from timeslice.lockd.profiles import build, fractions


def rec(token, job, enq, granted, released, group="g", busy=0, hint=0, swaps=(), elided=False, restored=False):
    return R.HoldRecord(group, job, token, enqueued_ms=enq, granted_ms=granted, released_ms=released,
                        hint_bytes=hint, prev_busy_ms=busy, swaps=list(swaps), elided=elided, restored=restored)


def one(profiles, job, group="g"):
    return next(p for p in profiles if p.job == job and p.group == group)


def test_hold_gap_wait_and_the_jobs_own_hold():
    recs = [rec(10, "a", 1000, 1005, 1205),
            rec(12, "a", 1505, 1512, 1722, busy=190),       # carries a's measure of its hold at token 10
            rec(14, "a", 2032, 2041, 2261, busy=5000)]      # longer than the lock saw: not believed
    p = one(build(recs), "a")
    assert p.hold_ms == [200, 210, 220] and p.wait_ms == [5, 7, 9] and p.gap_ms == [300, 310]
    assert p.busy_ms == [190] and p.grants == 3 and p.first_ms == 1005 and p.updated_ms == 2261
    busy, wait = fractions(p)
    assert busy == pytest.approx(210 / (210 + 305 + 7)) and wait == pytest.approx(7 / (210 + 305 + 7))


def test_records_are_read_in_token_order_and_per_group():
    recs = [rec(30, "a", 700, 710, 800), rec(20, "a", 0, 10, 100), rec(25, "a", 50, 60, 90, group="h")]
    ps = build(recs)
    assert one(ps, "a").hold_ms == [90, 90] and one(ps, "a").gap_ms == [600]
    assert one(ps, "a", "h").gap_ms == []                  # a gap only between holds of one group


def test_swaps_are_credited_to_the_job_they_moved():
    swaps = [{"node": "n1", "job": "b", "op": R.SNAPSHOT, "bytes": 4000, "elapsed_ms": 12.4,
              "gpu_bytes": {"gpu-0": 4000}},
             {"node": "n1", "job": "a", "op": R.RESTORE, "bytes": 3000, "elapsed_ms": 9.6,
              "gpu_bytes": {"gpu-0": 3000}},
             {"node": "n1", "job": "other-group-job", "op": R.SNAPSHOT, "bytes": 1, "elapsed_ms": 1},
             {"node": "n1", "job": "a", "op": R.FREEZE, "bytes": 0, "elapsed_ms": 1}]
    ps = build([rec(5, "b", 0, 1, 50, hint=100), rec(7, "a", 40, 80, 120, swaps=swaps, restored=True)])
    a, b = one(ps, "a"), one(ps, "b")
    assert a.restore_ms == [10] and a.snapshot_ms == [] and a.restored == 1 and a.gpu_bytes == {"n1/gpu-0": 3000}
    assert b.snapshot_ms == [12] and b.host_bytes == 4000 and b.swap_bytes == [4000]
    assert b.device_bytes == 4000                            # the answer's bytes beat the queue hint


def test_live_footprints_come_from_the_groups_agents():
    agent = R.AgentValue(node="n1", backend="sim", job_gpus={"a": {"gpu-0": 700, "gpu-1": 500}})
    far = R.AgentValue(node="n9", backend="sim", job_gpus={"a": {"gpu-0": 9999}})
    p = one(build([rec(1, "a", 0, 1, 5)], {"n1": agent, "n9": far}, {"g": ["n1"]}), "a")
    assert p.gpu_bytes == {"n1/gpu-0": 700, "n1/gpu-1": 500} and p.device_bytes == 1200


def test_only_the_newest_phases_are_kept():
    recs = [rec(i + 1, "a", 100 * i, 100 * i + 1, 100 * i + 1 + i) for i in range(10)]
    assert one(build(recs, phases=4), "a").hold_ms == [6, 7, 8, 9]


def test_nothing_recorded_is_no_profile():
    assert build([]) == []


def test_the_footprint_recorded_at_each_release_is_kept_at_its_peak():
    a = rec(1, "a", 0, 1, 5)
    a.gpu_bytes = {"n1/gpu-0": 300, "n1/gpu-1": 200}
    b = rec(2, "a", 10, 11, 15)
    b.gpu_bytes = {"n1/gpu-0": 500}
    p = one(build([a, b]), "a")
    assert p.gpu_bytes == {"n1/gpu-0": 500, "n1/gpu-1": 200} and p.device_bytes == 500
