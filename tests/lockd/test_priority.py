"""Priority classes, sans-IO (lockd/priority.py and its use in plan.py): hand-made states in, decisions out."""
import pytest
from aetcd import rpc

from timeslice.common.errors import InvalidIdError
from timeslice.common.server import records as R
from timeslice.lockd import plan as P
from timeslice.lockd import priority as PR
from timeslice.lockd import rekey as RK
from timeslice.lockd.index import GroupState, NodeState

SPEC = R.GroupSpec([{"node": "n1", "gpus": []}], priorities=True, max_overtakes=2, max_wait_ms=0)


def kv(key, value, create=1, mod=None, lease=0):
    return rpc.KeyValue(key=key.encode(), value=value if isinstance(value, bytes) else value.dump(),
                        create_revision=create, mod_revision=mod or create, lease=lease)


def group(queue, grant=None, turns=None, spec=SPEC):
    """queue: (job, token, class[, since_grants[, enqueued_ms[, since]]])."""
    gs = GroupState(spec=kv("spec", spec))
    for job, tok, cls, *rest in queue:
        sg, enq, since = (list(rest) + [0, 0, 0])[:3]
        gs.queue[job] = kv(f"q/{job}", R.QueueValue(job, 100 + tok, 0, enq, priority=cls, since_grants=sg,
                                                    since=since), create=tok, lease=100 + tok)
    if grant:
        gs.grant = kv("grant", R.GrantValue(grant[0], grant[1], 7))
    if turns:
        gs.turns = kv("turns", R.TurnsValue(*turns), create=1, mod=turns[2] if len(turns) > 2 else 3)
    return gs


def plan(gs, now=0, nodes=None):
    return P.plan_group(gs, nodes or {}, {}, now)


def test_fifo_group_is_untouched():
    """No priorities: the plain FIFO head, the grant as before (no turns key written, counted or raised)."""
    gs = group([("L", 5, 0), ("H", 9, 0)], spec=R.GroupSpec([{"node": "n1", "gpus": []}]))
    acts = plan(gs)
    assert acts == [P.WriteGrant("L", 5, 105, False, False, 0)] and acts[0].turns_rev == -1
    # Stored values of a FIFO group keep their bytes: the new fields are left out while default.
    assert b"priorit" not in R.GroupSpec([]).dump() and b"since" not in R.QueueValue("j").dump()


def test_higher_class_overtakes_after_raising_turns_and_moving_the_overtaken():
    gs = group([("L", 5, 0), ("H", 9, 3)])
    acts = plan(gs)
    assert acts == [P.RaiseTurns(9, 0, b"")] and R.TurnsValue.load(acts[0].value).token == 9
    # Raised: L's key (5) is below it, so L is moved out first, its arrival kept in the value.
    gs.turns = kv("turns", R.TurnsValue(9, 0), mod=12)
    acts = plan(gs)
    assert acts == [RK.MoveOut("L", 5, 5, 105, b"")] and R.QueueValue.load(acts[0].value).since == 5
    # Out (marker, no entry): moved in again.
    moved = acts[0].value
    del gs.queue["L"]
    gs.moving["L"] = kv("m/L", moved, create=13, lease=105)
    assert plan(gs) == [RK.MoveIn("L", 13, 105, b"")] and plan(gs)[0].value == moved
    # In again under key 14: H is granted, counting the grant over the turns key as planned.
    del gs.moving["L"]
    gs.queue["L"] = kv("q/L", moved, create=14, lease=105)
    acts = plan(gs)
    assert acts == [P.WriteGrant("H", 9, 109, False, False, 0)]
    assert acts[0].turns_rev == 12 and R.TurnsValue.load(acts[0].turns_next).grants == 1


def test_marker_beside_an_entry_is_dropped():
    gs = group([("L", 15, 0)], turns=(9, 1))
    gs.moving["L"] = kv("m/L", R.QueueValue("L", since=5), create=13, mod=13)
    assert plan(gs) == [RK.DropMarker("L", 13)]


def test_the_last_raised_head_overtaken_in_turn():
    # turns were raised to H's key (9) and H is not granted yet; X (class 9, key 12) now goes
    # first: H (key 9 = the turns token, not stale) is overtaken, so turns go up again.
    gs = group([("H", 9, 3), ("X", 12, 9)], turns=(9, 1))
    assert plan(gs) == [P.RaiseTurns(12, 3, b"")]


def test_no_raise_when_nobody_is_overtaken():
    gs = group([("H", 5, 3), ("L", 9, 0)])
    acts = plan(gs)
    assert acts == [P.WriteGrant("H", 5, 105, False, False, 0)] and acts[0].turns_rev == 0


def test_fifo_within_a_class():
    gs = group([("A", 5, 2), ("B", 7, 2), ("C", 9, 1)])
    assert PR.head_of(gs, SPEC, 0).job == "A"
    # Arrival, not key: B re-keyed (since=4) is ahead of A (arrived at 5).
    gs = group([("A", 5, 2), ("B", 11, 2, 0, 0, 4)])
    assert PR.head_of(gs, SPEC, 0).job == "B"


def test_a_moving_or_stale_class_head_is_waited_for():
    # L (key 5) was overtaken by a grant of token 9: its class head is stale; M may not slip past.
    gs = group([("L", 5, 0), ("M", 11, 0)], turns=(9, 1))
    assert PR.stale(gs, 5) and not PR.stale(gs, 11)
    h = PR.head_of(gs, SPEC, 0)
    assert h.job == "L" and not h.ready
    assert [type(a) for a in plan(gs)] == [RK.MoveOut]
    # Out: still the class head (by its arrival), not ready; the plan moves it in, grants nobody.
    gs = group([("M", 11, 0)], turns=(9, 1))
    gs.moving["L"] = kv("m/L", R.QueueValue("L", since=5), create=12)
    h = PR.head_of(gs, SPEC, 0)
    assert h.job == "L" and not h.ready
    assert [type(a) for a in plan(gs)] == [RK.MoveIn]
    # Back under key 13 (arrival 5 kept) it goes before M, whose key (11) it now overtakes:
    # turns first (M is moved in turn), then the grant.
    gs = group([("M", 11, 0), ("L", 13, 0, 0, 0, 5)], turns=(9, 1))
    assert plan(gs) == [P.RaiseTurns(13, 3, b"")]
    gs = group([("M", 15, 0, 0, 0, 11), ("L", 13, 0, 0, 0, 5)], turns=(9, 1))
    assert plan(gs) == [P.WriteGrant("L", 13, 113, False, False, 0)]


def test_aging_by_grants_serves_the_starved_first():
    # max_overtakes=2: L joined when 0 grants were made; after 2 it goes before the higher class.
    gs = group([("L", 5, 0, 0), ("H", 9, 5, 1)], turns=(0, 1))
    assert PR.head_of(gs, SPEC, 0).job == "H"
    gs = group([("L", 5, 0, 0), ("H", 9, 5, 1)], turns=(0, 2))
    h = PR.head_of(gs, SPEC, 0)
    assert h.job == "L" and h.raise_to == 0
    # Two aged classes: arrival order among them.
    gs = group([("H", 5, 5, 0), ("L", 7, 0, 0)], turns=(0, 2))
    assert PR.head_of(gs, SPEC, 0).job == "H"


def test_aging_by_time():
    spec = R.GroupSpec([{"node": "n1", "gpus": []}], priorities=True, max_overtakes=100, max_wait_ms=1000)
    gs = group([("L", 5, 0, 0, 10_000), ("H", 9, 5, 0, 10_500)], spec=spec)
    assert PR.head_of(gs, spec, 10_900).job == "H"
    assert PR.head_of(gs, spec, 11_000).job == "L"


def test_holder_and_swap_under_way_keep_their_turn():
    gs = group([("L", 5, 0), ("X", 20, 9)], grant=("L", 5))
    assert plan(gs) == []                      # a holder is never preempted (and its grant not dropped)
    gs = group([("L", 5, 0), ("X", 20, 9)])
    ns = NodeState(intents={"A": kv("in/A", R.IntentValue(R.SNAPSHOT, "A", "g", 5, 7), create=6)})
    assert PR.head_of(gs, SPEC, 0, {5}).job == "L"
    assert P.pick_head(gs, SPEC, {"n1": ns}, 0)[0][0] == "L"


def test_bounds_and_classes_are_validated():
    assert PR.check_bounds(False, 0, 0) == (0, 0)
    assert PR.check_bounds(True, 0, 0) == (PR.DEFAULT_MAX_OVERTAKES, 0)
    assert PR.check_bounds(True, 3, 5000) == (3, 5000)
    for bad in [(False, 3, 0), (False, 0, 1000), (True, PR.MAX_OVERTAKES + 1, 0), (True, 1, PR.MAX_WAIT_MS + 1)]:
        with pytest.raises(InvalidIdError):
            PR.check_bounds(*bad)
    PR.check_priority(SPEC, PR.MAX_PRIORITY, "g")
    PR.check_priority(R.GroupSpec([]), 0, "g")
    with pytest.raises(InvalidIdError):
        PR.check_priority(SPEC, PR.MAX_PRIORITY + 1, "g")
    with pytest.raises(InvalidIdError):
        PR.check_priority(R.GroupSpec([]), 1, "g")


def test_moved_value_keeps_the_first_arrival():
    v = R.QueueValue("j", priority=2, since_grants=3).dump()
    once = RK.moved_value(v, 5)
    assert R.QueueValue.load(once).since == 5
    assert RK.moved_value(once, 9) == once, "moved again: the same bytes (the waiter recognises its entry)"


def test_status_order():
    gs = group([("L", 5, 0), ("H", 9, 3), ("M", 11, 3)], grant=("L", 5))
    assert [j for j, _ in PR.order(gs, SPEC, 0)] == ["L", "H", "M"]
    gs = group([("L", 5, 0, 0), ("H", 9, 3, 2), ("M", 11, 3, 2)], turns=(0, 2))
    assert [j for j, _ in PR.order(gs, SPEC, 0)] == ["L", "H", "M"]


def test_planned_head_for_metrics_and_traces():
    gs = group([("L", 5, 0), ("H", 9, 3)])
    gs.parsed = SPEC
    assert PR.planned_head(gs, 0)[0] == "H"
    fifo = group([("L", 5, 0), ("H", 9, 3)], spec=R.GroupSpec([]))
    fifo.parsed = R.GroupSpec([])
    assert PR.planned_head(fifo, 0)[0] == "L"
