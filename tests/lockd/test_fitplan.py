"""A fit group's planner (lockd/fitplan.py), sans-IO: grants side by side where the footprints fit,
exclusive time-slicing where they do not, backfill that never delays the head."""
from tests.lockd.test_plan import GB, agent4, intent, kv, snap, status, worker_on
from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.lockd import plan as P
from timeslice.lockd import rekey as RK
from timeslice.lockd.index import GroupState, JobState, NodeState

SPEC = R.GroupSpec([{"node": "n1", "gpus": [0]}], sharing=R.SHARING_FIT)


def fit_group(queue, holders=(), turns=None, spec=SPEC):
    """``queue``: (job, token, hint GB[, exclusive]); ``holders``: (job, footprint GB or None = whole device)."""
    gs = GroupState(spec=kv("spec", spec), parsed=spec)
    for job, tok, hint, *excl in queue:
        gs.queue[job] = kv(f"q/{job}", R.QueueValue(job, 100 + tok, hint * GB, exclusive=bool(excl and excl[0])),
                           create=tok, lease=100 + tok)
    for job, fp in holders:
        tok = gs.queue[job].create_revision
        g = R.GrantValue(job, tok, 7, footprint={} if fp is None else {"n1/0": fp * GB}, exclusive=fp is None)
        gs.shared[job] = kv(f"grants/{job}", g, create=tok + 1)
    if turns is not None:
        gs.turns = kv("turns", R.TurnsValue(turns, 0), create=turns, mod=turns)
    return gs


def jobs(*names):
    return {j: JobState(session=kv("s", b"{}"), workers=worker_on(j, 10 + i, gpus=(0,)))
            for i, j in enumerate(names)}


def node(free_gb, seen=None):
    """GPU 0 of 80 GB with ``free_gb`` free; ``seen``: job -> GB the agent sees it hold there."""
    seen = seen or {}
    return {"n1": NodeState(agent=agent4([free_gb * GB], {j: {"gpu0": b * GB} for j, b in seen.items()},
                                         {j: b * GB for j, b in seen.items()}))}


def held_by(gs):
    return lambda j: [SPEC] if j in gs.shared else []


# The footprint is what the job declares, exactly (no context, margin or first hold's spare): the
# semaphore's arithmetic is read off the hints below. The rule itself: tests/lockd/test_footprints.py.
EXACT = P.Policy(footprint=FP.FootprintPolicy(context_fraction=0, margin_fraction=0, first_hold_spare=0))


def plan(gs, nodes, js, now=0, policy=EXACT):
    return P.plan_group(gs, nodes, js, now, policy, holding=held_by(gs))


def test_the_head_is_granted_at_once_beside_the_holders_when_it_fits_with_what_it_weighs():
    gs = fit_group([("A", 5, 30), ("B", 9, 30)], holders=[("A", 30)])
    acts = plan(gs, node(50, {"A": 30}), jobs("A", "B"))
    assert acts == [P.WriteGrant("B", 9, 109, False, True, 0, shared=True)]
    assert acts[0].footprint == {"n1/0": 30 * GB} and acts[0].holders_rev == 6
    assert acts[0].stored(7).footprint == {"n1/0": 30 * GB}


def test_a_head_that_does_not_fit_waits_for_holders_to_yield_and_then_goes():
    gs = fit_group([("A", 5, 30), ("B", 9, 60)], holders=[("A", 30)])
    assert plan(gs, node(50, {"A": 30}), jobs("A", "B")) == []          # 30 + 60 > 80: exclusive time-slicing
    del gs.shared["A"], gs.queue["A"]                                   # A yields
    acts = plan(gs, node(50, {"A": 30}), jobs("A", "B"))
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]        # A is parked to make room, as ever


def test_an_unknown_footprint_weighs_the_whole_device_and_so_does_a_phase_that_asks_for_it():
    gs = fit_group([("A", 5, 10), ("B", 9, 0)], holders=[("A", 10)])
    assert plan(gs, node(70, {"A": 10}), jobs("A", "B")) == []          # no declaration: never beside another
    gs = fit_group([("A", 5, 10), ("B", 9, 10, True)], holders=[("A", 10)])
    assert plan(gs, node(70, {"A": 10}), jobs("A", "B")) == []          # acquire(..., exclusive=True)
    gs = fit_group([("B", 9, 10, True)])
    acts = plan(gs, node(70, {}), jobs("B"))
    assert acts == [P.WriteGrant("B", 9, 109, False, False, 0, shared=True, exclusive=True)]
    assert acts[0].stored(7).exclusive and acts[0].stored(7).footprint == {}


def test_an_exclusive_holder_is_alone():
    gs = fit_group([("A", 5, 0), ("B", 9, 1)], holders=[("A", None)])
    assert plan(gs, node(79, {"A": 1}), jobs("A", "B")) == []


def test_the_holders_room_to_grow_is_kept_and_parked_jobs_make_it():
    # A holds 30 GB admitted and uses 5 now; P (parked, holding nothing) keeps 10: 65 free.
    gs = fit_group([("A", 5, 30), ("B", 9, 45)], holders=[("A", 30)])
    js = jobs("A", "B", "P")
    # By the footprints 30 + 45 <= 80, but only 65 - 25 (A's room) = 40 is free for B: P goes.
    assert plan(gs, node(65, {"A": 5, "P": 10}), js) == [P.WriteIntent("n1", "P", R.SNAPSHOT, 9, 0)]
    # Without P: 75 - 25 = 50 >= 45: granted beside A.
    js.pop("P")
    assert [a.job for a in plan(gs, node(75, {"A": 5}), js)] == ["B"]


def test_a_holder_is_never_parked_for_another_grant():
    # A uses more than its footprint now (50 GB): B fits by the footprints (30 + 40) but not on the device.
    gs = fit_group([("A", 5, 30), ("B", 9, 40)], holders=[("A", 30)])
    assert plan(gs, node(30, {"A": 50}), jobs("A", "B")) == []


def test_a_stale_holder_is_dropped_by_its_own_key():
    gs = fit_group([("A", 5, 30), ("B", 9, 30)], holders=[("A", 30), ("B", 30)])
    del gs.queue["A"]
    acts = plan(gs, node(50, {}), jobs("A", "B"))
    assert acts == [P.DropGrant(gs.shared["A"].value, "A")] and acts[0].key == b"grants/A"


def test_backfill_raises_the_turns_token_rekeys_the_head_then_grants_and_the_head_goes_first_when_it_fits():
    js = jobs("A", "H", "B", "C")
    # A and H hold 30 GB each; head B (40) does not fit; C (10) fits now, and beside B after either yields.
    gs = fit_group([("A", 3, 30), ("H", 4, 30), ("B", 9, 40), ("C", 11, 10)], holders=[("A", 30), ("H", 30)])
    nodes = node(80, {})
    acts = plan(gs, nodes, js)
    assert len(acts) == 1 and isinstance(acts[0], P.RaiseTurns) and acts[0].token == 11
    gs.turns = kv("turns", acts[0].value, create=12, mod=12)
    # B's key is below the turns token now: it re-keys (its arrival kept) before anything else.
    acts = plan(gs, nodes, js)
    assert [type(a) for a in acts] == [RK.MoveOut] and acts[0].job == "B"
    assert R.QueueValue.load(acts[0].value).since == 9
    del gs.queue["B"]
    gs.queue["B"] = kv("q/B", acts[0].value, create=14, lease=109)
    # Now C is granted, flagged as backfilled; its token (11) is below B's new one (14).
    acts = plan(gs, nodes, js)
    assert acts == [P.WriteGrant("C", 11, 111, False, True, 0, shared=True, backfilled=True)]
    gs.shared["C"] = kv("grants/C", acts[0].stored(7), create=15)
    # Nobody else is backfilled past B meanwhile: D (10) would fit now, not beside B and one holder.
    gs.queue["D"] = kv("q/D", R.QueueValue("D", 116, 10 * GB), create=16, lease=116)
    js.update(jobs("A", "H", "B", "C", "D"))
    assert plan(gs, nodes, js) == []
    # A yields: B, first by arrival, fits beside H and C (30 + 10 + 40 = 80) and goes before D.
    del gs.shared["A"], gs.queue["A"]
    acts = plan(gs, nodes, js)
    assert acts == [P.WriteGrant("B", 14, 109, False, True, 0, shared=True)]


def test_no_backfill_that_could_delay_the_head():
    # A, H hold 30 each; head B needs 40 (30 + 30 + 40 > 80 now; beside either alone it fits: 70).
    # C (15) fits now (75) but beside B and one holder it would not (85): refused.
    gs = fit_group([("A", 3, 30), ("H", 4, 30), ("B", 9, 40), ("C", 11, 15)], holders=[("A", 30), ("H", 30)])
    assert plan(gs, node(80, {}), jobs("A", "H", "B", "C")) == []
    # 10 GB (80 beside B and one holder) is fine.
    gs = fit_group([("A", 3, 30), ("H", 4, 30), ("B", 9, 40), ("C", 11, 10)], holders=[("A", 30), ("H", 30)])
    assert [type(a) for a in plan(gs, node(80, {}), jobs("A", "H", "B", "C"))] == [P.RaiseTurns]


def test_backfill_only_as_a_plain_grant():
    # C would fit, but it is snapshotted: its restore is a swap that could hold the head up. Not backfilled.
    gs = fit_group([("A", 3, 40), ("H", 4, 30), ("B", 9, 50), ("C", 11, 5)], holders=[("A", 40), ("H", 30)])
    nodes = node(10, {"A": 40, "H": 30})
    nodes["n1"].statuses["C"] = snap("C", {"gpu0": 5 * GB})
    assert plan(gs, nodes, jobs("A", "H", "B", "C")) == []


def test_a_head_whose_swap_has_begun_keeps_its_turn():
    gs = fit_group([("A", 5, 30), ("B", 9, 30), ("C", 11, 5)], holders=[("A", 30)])
    nodes = node(20, {"A": 30, "P": 30})
    nodes["n1"].intents["P"] = intent("P", R.SNAPSHOT, 9, mod=20)
    nodes["n1"].statuses["P"] = status("P", R.RUNNING)
    js = jobs("A", "B", "C", "P")
    assert plan(gs, nodes, js, now=2000) == []                         # waiting for the agent on B's behalf


def test_a_strict_fit_group_freezes_the_jobs_that_hold_nothing_never_a_co_holder():
    spec = R.GroupSpec([{"node": "n1", "gpus": [0]}], isolation=R.ISOLATION_STRICT, sharing=R.SHARING_FIT)
    gs = fit_group([("A", 5, 10), ("B", 9, 10)], holders=[("A", 10)], spec=spec)
    js = jobs("A", "B", "P")                                  # P yielded earlier and stays resident
    acts = P.plan_group(gs, node(60, {"A": 10, "P": 10}), js, 0, EXACT, holding=lambda j: [spec] if j == "A" else [])
    assert acts == [P.WriteIntent("n1", "P", R.FREEZE, 9, 0)]   # P frozen before B's grant; A, holding, runs on


def test_the_weight_is_the_footprint_rule_a_first_hold_with_room_to_spare():
    # A holds 45 GB; B declares 30: 75 <= 80 by the declaration, but by the footprint rule (context,
    # margin, a first hold's spare) B's first hold weighs ~39 GB, and waits; once B reported its peak
    # (30 GB), it weighs that plus its context and margin (~31 GB), and goes beside A.
    gs = fit_group([("A", 5, 45), ("B", 9, 30)], holders=[("A", 45)])
    assert P.plan_group(gs, node(50, {"A": 30}), jobs("A", "B"), 0, holding=held_by(gs)) == []
    gs.queue["B"] = kv("q/B", R.QueueValue("B", 109, 30 * GB, peak_bytes=30 * GB), create=9, lease=109)
    acts = P.plan_group(gs, node(50, {"A": 30}), jobs("A", "B"), 0, holding=held_by(gs))
    assert [a.job for a in acts] == ["B"] and 30 * GB < acts[0].footprint["n1/0"] < 32 * GB
