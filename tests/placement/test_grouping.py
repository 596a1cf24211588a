"""The advisor (timeslice.advise.grouping) and the profile file format, sans-IO."""
from __future__ import annotations

import json

import pytest

from copy import deepcopy

from timeslice.advise.grouping import Advisor, Options, Plan, advise
from timeslice.advise.profile import GpuSet, JobProfile, NodeInfo, ProfileFormatError, ProfileSet
from timeslice.advise.simulate import SimGroup, simulate

MiB = 1 << 20


def prof(job, group, hold, gap, wait=5, nbytes=40 * MiB, gpus=1, node="n1", snap=20, restore=20):
    return JobProfile(job=job, group=group, hold_ms=[hold] * 8, gap_ms=[gap] * 8, wait_ms=[wait] * 8,
                      snapshot_ms=[snap] * 4, restore_ms=[restore] * 4,
                      gpu_bytes={f"{node}/gpu-{i}": nbytes for i in range(gpus)}, device_bytes=nbytes * gpus)


def cluster(profiles, sets, gpu_bytes=64 * MiB, host=1 << 40, gpus_per_node=8):
    nodes = sorted({n for s in sets for n, _ in s.nodes})
    infos = [NodeInfo(n, host, [{"id": f"gpu-{i}", "index": i, "total_bytes": gpu_bytes}
                                for i in range(gpus_per_node)]) for n in nodes]
    return ProfileSet(profiles, sets, infos)


def one_gpu_sets(names, node="n1"):
    return [GpuSet(g, [(node, [i])]) for i, g in enumerate(names)]


def test_heavy_jobs_are_paired_with_light_ones_not_with_each_other():
    # Today: the two heavy jobs share g0 (overloaded), the two light ones g1 (half idle).
    ps = cluster([prof("h1", "g0", 300, 200), prof("h2", "g0", 300, 200),
                  prof("l1", "g1", 100, 400), prof("l2", "g1", 100, 400)], one_gpu_sets(["g0", "g1"]))
    adv = advise(ps, Options(max_slowdown=0.15, overhead_s=0.005))
    groups = {frozenset(p.jobs) for p in adv.proposal.groups}
    assert all(len(g) <= 3 for g in groups)
    assert not any({"h1", "h2"} <= g for g in groups)
    assert max(adv.proposal.slowdown().values()) <= 0.15
    assert max(adv.today.slowdown().values()) > 0.15          # today's heavy pair waits for each other
    today_ok = [p for p in adv.today.groups if p.feasible]
    assert len(today_ok) == 1 and today_ok[0].jobs == ("l1", "l2")


def test_complementary_jobs_are_merged_onto_fewer_gpus():
    ps = cluster([prof(f"j{i}", f"g{i}", 100, 300, nbytes=20 * MiB) for i in range(4)],
                 one_gpu_sets([f"g{i}" for i in range(4)]))
    adv = advise(ps, Options(overhead_s=0.005))
    assert adv.proposal.gpus < adv.today.gpus
    assert adv.proposal.duty > adv.today.duty + 0.2
    assert all(s <= 0.15 for s in adv.proposal.slowdown().values())
    # Each proposed group gets the GPUs of one of its members' groups, no set twice.
    sets = [p.gpu_set for p in adv.proposal.groups]
    assert len(set(sets)) == len(sets) and all(sets)


def test_the_slowdown_bound_is_respected():
    ps = cluster([prof(f"j{i}", f"g{i}", 100, 300) for i in range(3)], one_gpu_sets(["g0", "g1", "g2"]))
    tight = advise(ps, Options(max_slowdown=0.0, overhead_s=0.005))
    assert all(len(p.jobs) == 1 for p in tight.proposal.groups)
    loose = advise(ps, Options(max_slowdown=1.0, overhead_s=0.005))
    assert any(len(p.jobs) > 1 for p in loose.proposal.groups)


def test_jobs_on_different_numbers_of_gpus_never_share():
    sets = [GpuSet("one", [("n1", [0])]), GpuSet("four", [("n1", [1, 2, 3, 4])])]
    ps = cluster([prof("a", "one", 100, 400), prof("b", "four", 100, 400, gpus=4)], sets)
    adv = advise(ps, Options(overhead_s=0.005))
    assert sorted(p.jobs for p in adv.proposal.groups) == [("a",), ("b",)]
    assert Advisor(ps).gpus_of("b") == 4


def test_host_memory_too_small_for_the_parked_snapshots():
    ps = cluster([prof("a", "g0", 100, 400), prof("b", "g1", 100, 400)], one_gpu_sets(["g0", "g1"]),
                 host=10 * MiB)
    adv = advise(ps, Options(overhead_s=0.005))
    assert sorted(p.jobs for p in adv.proposal.groups) == [("a",), ("b",)]
    assert "host memory" in Advisor(ps, Options(overhead_s=0.005)).evaluate(("a", "b")).why


def test_calibration_recovers_the_control_plane_cost():
    # Waits measured on a cluster whose grants and swap steps cost 20 ms each.
    jobs = [prof("a", "g0", 200, 300), prof("b", "g0", 200, 300)]
    base = Advisor(cluster(jobs, one_gpu_sets(["g0"])))
    res = simulate([base.jobs["a"], base.jobs["b"]], SimGroup(64 * MiB, 0.02, 0.02))
    for p in jobs:
        p.wait_ms = [round(res.jobs[p.job].mean_wait_s * 1000)] * 8
    adv = Advisor(cluster(jobs, one_gpu_sets(["g0"]))).advise()
    assert adv.overhead_s == pytest.approx(0.02, abs=0.003)


def test_never_more_groups_than_gpu_sets_even_past_the_bound():
    # Two heavy jobs and one GPU set: they must share it; the proposal says the bound is broken.
    ps = cluster([prof("h1", "g0", 300, 200), prof("h2", "g0", 300, 200)], one_gpu_sets(["g0"]))
    adv = advise(ps, Options(overhead_s=0.005))
    assert [p.jobs for p in adv.proposal.groups] == [("h1", "h2")]
    assert not adv.proposal.groups[0].feasible and "bound" in adv.proposal.groups[0].why
    assert adv.proposal.groups[0].gpu_set == "g0"


def test_a_job_never_swapped_is_estimated_at_the_rate_the_others_swapped():
    swapped = prof("a", "g0", 100, 400, nbytes=40 * MiB, snap=400, restore=200)    # 0.1 GB/s, 0.2 GB/s
    never = prof("b", "g1", 100, 400, nbytes=20 * MiB)
    never.snapshot_ms, never.restore_ms = [], []
    adv = Advisor(cluster([swapped, never], one_gpu_sets(["g0", "g1"])))
    assert adv.jobs["b"].snapshot_s == pytest.approx(0.2) and adv.jobs["b"].restore_s == pytest.approx(0.1)
    alone = Advisor(cluster([never], one_gpu_sets(["g1"])))          # nobody swapped: the default rate
    assert alone.jobs["b"].snapshot_s == pytest.approx(20 * MiB / 10e9)


def test_jobs_without_phases_are_skipped():
    ps = cluster([prof("a", "g0", 100, 400), JobProfile("new", "g0", hold_ms=[5])], one_gpu_sets(["g0"]))
    assert advise(ps, Options(overhead_s=0.005)).skipped == ["new"]


def test_the_profile_file_round_trips_and_bad_files_are_refused():
    ps = cluster([prof("a", "g0", 100, 400)], one_gpu_sets(["g0"]))
    again = ProfileSet.from_dict(json.loads(json.dumps(ps.to_dict())))
    assert again.profiles[0].hold_ms == ps.profiles[0].hold_ms and again.groups == ps.groups
    assert again.nodes[0].gpu_total(0) == 64 * MiB
    for bad in [{}, {"version": 99, "profiles": []}, {"version": 1, "profiles": [{"job": "a"}]},
                {"version": 1, "profiles": [{"job": "a", "group": "g", "hold_ms": [-1]}]},
                {"version": 1, "profiles": [], "groups": [{"nodes": []}]}]:
        with pytest.raises(ProfileFormatError):
            ProfileSet.from_dict(bad)


@pytest.mark.parametrize("kw", [{"max_slowdown": -1}, {"max_group_size": 0}, {"gbps": 0}, {"cycles": 1}])
def test_bad_options(kw):
    with pytest.raises(ValueError):
        Options(**kw)


def test_a_grouping_predicted_worse_than_todays_is_never_proposed():
    """Over random mixes (the placement benchmark's ranges), the proposal is never predicted worse
    than today's grouping: not more jobs past the bound, not less duty with as many. Without the
    guard the search ended on worse groupings in about 1 mix in 20 (merging down to the GPU sets
    there are, or a local optimum), as benchmarks/results/placement.json's mixes 2 and 4 did."""
    import random
    rng = random.Random(3)
    kept = 0
    for _ in range(60):
        n = rng.choice([3, 4])
        sets = rng.choice([2, 2, 3]) if n == 4 else 2
        jobs = []
        for i in range(n):
            nb = rng.choice([8, 16, 24, 32, 40]) * MiB
            jobs.append(prof(f"j{i}", f"g{i % sets}", rng.randint(50, 400), rng.randint(150, 1500), nbytes=nb,
                             snap=int(nb / 0.5e6), restore=int(nb / 1e6)))
        adv = advise(cluster(jobs, one_gpu_sets([f"g{k}" for k in range(sets)])),
                     Options(max_slowdown=0.15, overhead_s=0.005, cycles=60))
        p, t = adv.proposal, adv.today
        assert p.over(0.15) <= t.over(0.15), (jobs, adv.to_dict())
        if p.over(0.15) == t.over(0.15):
            assert p.same_as(t) or p.duty >= t.duty + 0.005, (jobs, adv.to_dict())
        if adv.kept:
            kept += 1
            assert p.same_as(t) and adv.to_dict()["gain"] == 0 and adv.to_dict()["kept"] == adv.kept
    assert kept >= 1                                # the guard had something to do


def test_why_a_proposal_is_not_worth_it():
    ps = cluster([prof("a", "g0", 100, 400), prof("b", "g1", 100, 400)], one_gpu_sets(["g0", "g1"]))
    a = Advisor(ps, Options(overhead_s=0.005))
    today = Plan([a.evaluate(("a",)), a.evaluate(("b",))])
    together = Plan([a.evaluate(("a", "b"))])
    assert "today's grouping" in a.no_better(Plan(list(today.groups)), today)
    assert a.no_better(together, today) == ""                       # one GPU at a higher duty: worth it
    assert "predicts" in a.no_better(today, together)               # less duty, as many past the bound
    slow = Plan([deepcopy(a.evaluate(("a", "b")))])
    for j in slow.groups[0].result.jobs.values():
        j.slowdown = 0.5
    assert "past 15%" in a.no_better(slow, today)


def test_a_better_grouping_is_still_proposed():
    ps = cluster([prof("h1", "g0", 300, 200), prof("h2", "g0", 300, 200),
                  prof("l1", "g1", 100, 400), prof("l2", "g1", 100, 400)], one_gpu_sets(["g0", "g1"]))
    adv = advise(ps, Options(max_slowdown=0.15, overhead_s=0.005))
    assert adv.kept == "" and not adv.proposal.same_as(adv.today)
    assert adv.proposal.duty >= adv.today.duty + 0.005 or adv.proposal.over(0.15) < adv.today.over(0.15)
