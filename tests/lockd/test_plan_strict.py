"""Strict groups in the planner: on an elided handoff the jobs left on the group's GPUs
are frozen before the grant, and a frozen job is thawed before its own next grant. Sans-IO."""
from tests.lockd.test_plan import GB, agent4, group_gpus, intent, kv, status, worker_on
from timeslice.common.server import records as R
from timeslice.lockd import plan as P
from timeslice.lockd.index import JobState, NodeState


def strict(queue, gpus=(0,)):
    gs = group_gpus(queue, gpus)
    gs.spec = kv("spec", R.GroupSpec([{"node": "n1", "gpus": list(gpus)}], isolation=R.ISOLATION_STRICT))
    return gs


def two_jobs():
    return {"A": JobState(session=kv("s", b"{}"), workers=worker_on("A", 1)),
            "B": JobState(session=kv("s", b"{}"), workers=worker_on("B", 2))}


def fits(a_state=None):
    """A resident on GPU 0 with 10 GB; 70 GB free there: B (10 GB) fits beside it."""
    ns = NodeState(agent=agent4([70 * GB], {"A": {"gpu0": 10 * GB}}, {"A": 10 * GB}))
    if a_state:
        ns.statuses["A"] = status("A", a_state)
    return ns


def test_an_elided_handoff_in_a_strict_group_freezes_the_yielded_job_before_the_grant():
    ns = fits()
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, two_jobs(), 0) == [
        P.WriteIntent("n1", "A", R.FREEZE, 9, 0)]
    # Issued, not answered: the grant waits.
    ns.intents["A"] = intent("A", R.FREEZE, 9, mod=20)
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, two_jobs(), 0) == []
    # Answered: A is frozen in place; B is granted, elided (nothing moved).
    ns.statuses["A"] = status("A", R.FROZEN, R.OK, intent_rev=20, token=9)
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, two_jobs(), 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_a_failed_freeze_fails_the_waiter_with_the_reason():
    ns = fits()
    ns.intents["A"] = intent("A", R.FREEZE, 9, mod=20)
    ns.statuses["A"] = status("A", R.RUNNING, R.FAILED, intent_rev=20, token=9, error="lock timed out")
    [f] = P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, two_jobs(), 0)
    assert isinstance(f, P.FailWaiter) and "freeze of job A" in f.reason and "lock timed out" in f.reason


def test_a_group_without_strict_isolation_is_unchanged():
    for iso in (R.ISOLATION_NONE, R.ISOLATION_FULL):
        gs = strict([("B", 9, 10 * GB)])
        gs.spec = kv("spec", R.GroupSpec([{"node": "n1", "gpus": [0]}], isolation=iso))
        assert P.plan_group(gs, {"n1": fits()}, two_jobs(), 0) == [
            P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_a_frozen_job_is_thawed_before_its_next_grant_in_any_group():
    ns = fits(R.FROZEN)                       # A was frozen by an earlier strict handoff
    ns.agent = agent4([70 * GB], {"A": {"gpu0": 10 * GB}, "B": {}}, {"A": 10 * GB})   # B: no device here
    for gs in (strict([("A", 12, 10 * GB)]), group_gpus([("A", 12, 10 * GB)], [0])):
        assert P.plan_group(gs, {"n1": ns}, two_jobs(), 0) == [P.WriteIntent("n1", "A", R.THAW, 12, 0)]
    ns.intents["A"] = intent("A", R.THAW, 12, mod=30)
    ns.statuses["A"] = status("A", R.RUNNING, R.OK, intent_rev=30, token=12)
    assert P.plan_group(strict([("A", 12, 10 * GB)]), {"n1": ns}, two_jobs(), 0) == [
        P.WriteGrant("A", 12, 112, restored=False, elided=False, bytes_moved=0)]


def test_the_head_is_thawed_beside_the_freezes_and_granted_once_both_are_answered():
    jobs = two_jobs()
    ns = NodeState(agent=agent4([60 * GB], {"A": {"gpu0": 10 * GB}, "B": {"gpu0": 10 * GB}},
                                {"A": 10 * GB, "B": 10 * GB}), statuses={"B": status("B", R.FROZEN)})
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, jobs, 0) == [
        P.WriteIntent("n1", "A", R.FREEZE, 9, 0), P.WriteIntent("n1", "B", R.THAW, 9, 0)]
    ns.intents["A"] = intent("A", R.FREEZE, 9, mod=20)
    ns.intents["B"] = intent("B", R.THAW, 9, mod=21)
    ns.statuses["A"] = status("A", R.FROZEN, R.OK, intent_rev=20, token=9)
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, jobs, 0) == []     # B's thaw unanswered
    ns.statuses["B"] = status("B", R.RUNNING, R.OK, intent_rev=21, token=9)
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, jobs, 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_a_holder_of_another_group_on_those_gpus_is_never_frozen():
    held = {"A": [R.GroupSpec([{"node": "n1", "gpus": [0]}])]}
    acts = P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": fits()}, two_jobs(), 0,
                        holding=lambda j: held.get(j, []))
    assert acts == [P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_only_jobs_on_the_strict_groups_gpus_are_frozen():
    # A sits on GPU 1; the strict group is GPU 0 only.
    ns = NodeState(agent=agent4([70 * GB, 70 * GB], {"A": {"gpu1": 10 * GB}}, {"A": 10 * GB}))
    assert P.plan_group(strict([("B", 9, 10 * GB)], gpus=(0,)), {"n1": ns}, two_jobs(), 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]


def test_a_frozen_job_that_lost_its_session_is_fenced_already():
    # Frozen H, registrations gone (session expired while frozen): no wait for the agent.
    ns = NodeState(agent=agent4([70 * GB], {}, {"H": 10 * GB}), statuses={"H": status("H", R.FROZEN)})
    [g] = P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, {}, 0)
    assert isinstance(g, P.WriteGrant)
    ns.statuses["H"] = status("H", R.RUNNING)
    assert P.plan_group(strict([("B", 9, 10 * GB)]), {"n1": ns}, {}, 0) == []
