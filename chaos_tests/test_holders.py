"""The parked-holder check (chaos_tests/holders.py) on hand-made etcd histories."""
from __future__ import annotations

import json

from chaos_tests.holders import (Event, check_backfills_spare_the_head, check_grants_in_revision_order,
                                 check_holders_not_parked)
from timeslice.common.server.keys import Keys

K = Keys("/t/")


def put(rev, key, value):
    return Event(rev, key, json.dumps(value).encode())


def base(px_gpus=(0,)):
    return [put(1, K.spec("gA"), {"nodes": [{"node": "n1", "gpus": [0]}]}),
            put(2, K.spec("gB"), {"nodes": [{"node": "n1", "gpus": [1]}]}),
            put(3, K.worker("PX", "n1", 100), {"pid": 100, "node": "n1", "gpus": list(px_gpus)}),
            put(4, K.grant("gA"), {"job": "PX", "token": 4})]


def snapshot(rev, job="PX", group="gB"):
    return put(rev, K.intent("n1", job), {"op": "snapshot", "job": job, "group": group, "token": rev})


def test_a_snapshot_of_a_holder_on_its_groups_devices_is_a_violation():
    out = check_holders_not_parked([*base(), snapshot(9)], K)
    assert len(out) == 1 and out[0].startswith("[parked-holder] revision 9") and "gA" in out[0]


def test_after_the_yield_or_elsewhere_it_is_not():
    assert check_holders_not_parked([*base(), Event(8, K.grant("gA"), None), snapshot(9)], K) == []
    assert check_holders_not_parked([*base(px_gpus=(1,)), snapshot(9)], K) == []      # PX only on GPU 1
    restore = put(9, K.intent("n1", "PX"), {"op": "restore", "job": "PX", "group": "gA", "token": 9})
    assert check_holders_not_parked([*base(), restore], K) == []


def test_unknown_gpus_count_as_every_gpu():
    assert len(check_holders_not_parked([*base(px_gpus=()), snapshot(9)], K)) == 1
    whole_node = [put(1, K.spec("gA"), {"nodes": [{"node": "n1", "gpus": []}]}), *base(px_gpus=(3,))[1:]]
    assert len(check_holders_not_parked([*whole_node, snapshot(9)], K)) == 1


def test_a_fit_groups_co_holder_parked_is_a_violation_and_after_its_yield_it_is_not():
    fit = [*base()[:3], put(4, K.shared_grant("gA", "PX"), {"job": "PX", "token": 4}),
           put(5, K.shared_grant("gA", "PY"), {"job": "PY", "token": 5})]
    assert len(check_holders_not_parked([*fit, snapshot(9)], K)) == 1
    assert check_holders_not_parked([*fit, Event(8, K.shared_grant("gA", "PX"), None), snapshot(9)], K) == []


GB = 1 << 30


def agent(rev, total=80 * GB):
    return put(rev, K.agent("n1"), {"node": "n1", "gpus": [{"index": 0, "total_bytes": total}]})


def fit_grant(rev, job, token, gb=None):
    v = {"job": job, "token": token, **({"exclusive": True} if gb is None else {"footprint": {"n1/0": gb * GB}})}
    return put(rev, K.shared_grant("gA", job), v)


def test_fit_holders_within_capacity_in_revision_order_pass():
    events = [agent(1), fit_grant(2, "A", 2, 40), fit_grant(3, "B", 3, 40), Event(4, K.shared_grant("gA", "A"), None),
              fit_grant(6, "C", 5, 40), put(7, K.grant("gX"), {"job": "A", "token": 7}),
              put(8, K.grant("gX"), {"job": "B", "token": 8})]
    assert check_grants_in_revision_order(events, K) == []


def test_fit_holders_over_capacity_or_beside_an_exclusive_one_are_violations():
    over = [agent(1), fit_grant(2, "A", 2, 40), fit_grant(3, "B", 3, 41)]
    out = check_grants_in_revision_order(over, K)
    assert len(out) == 1 and out[0].startswith("[fit] revision 3")
    assert check_grants_in_revision_order([agent(1, 81 * GB), *over[1:]], K) == []
    assert len(check_grants_in_revision_order([agent(1, 81 * GB), *over[1:]], K, margin=GB)) == 1
    beside = [agent(1), fit_grant(2, "A", 2, None), fit_grant(3, "B", 3, 1)]
    assert check_grants_in_revision_order(beside, K)[0].startswith("[fit] revision 3")


def test_tokens_going_back_in_revision_order_are_a_violation_in_either_layout():
    assert check_grants_in_revision_order([agent(1), fit_grant(2, "A", 5, 1), fit_grant(3, "B", 4, 1)], K)
    back = [put(2, K.grant("gX"), {"job": "A", "token": 5}), put(3, K.grant("gX"), {"job": "B", "token": 4})]
    assert check_grants_in_revision_order(back, K)[0].startswith("[token-order] revision 3")


def queued(rev, job, since=0):
    return put(rev, K.queue_entry("gA", job), {"job": job, **({"since": since} if since else {})})


def backfill(rev, job, token, gb):
    return put(rev, K.shared_grant("gA", job), {"job": job, "token": token, "backfilled": True,
                                                "footprint": {"n1/0": gb * GB}})


def backfilled_past_b(*extra):
    """A holds 50 GB; B (40 GB, granted at last under a fresh key, its arrival kept) waits as the head;
    C (20 GB) is backfilled past it: B fits beside C, so C never keeps B waiting."""
    return [agent(1), queued(2, "A"), fit_grant(3, "A", 2, 50), queued(4, "B"), queued(5, "C"), backfill(6, "C", 5, 20),
            *extra, put(30, K.moving("gA", "B"), {"job": "B", "since": 4}), Event(30, K.queue_entry("gA", "B"), None),
            queued(31, "B", since=4), Event(32, K.moving("gA", "B"), None), Event(33, K.queue_entry("gA", "A"), None),
            Event(34, K.shared_grant("gA", "A"), None), fit_grant(35, "B", 31, 40)]


def test_backfills_that_leave_the_head_room_pass():
    assert check_backfills_spare_the_head(backfilled_past_b(), K) == []
    # D (20 GB) after C is still room for B (40 + 20 + 20 <= 80); a head never granted is not judged.
    assert check_backfills_spare_the_head(backfilled_past_b(queued(7, "D"), backfill(8, "D", 7, 20)), K) == []
    assert check_backfills_spare_the_head(backfilled_past_b()[:-1] + [queued(7, "D"), backfill(8, "D", 7, 45)], K) == []


def test_backfills_that_take_the_heads_room_are_starve_violations():
    out = check_backfills_spare_the_head(backfilled_past_b(queued(7, "D"), backfill(8, "D", 7, 25)), K)
    assert len(out) == 1 and out[0].startswith("[starve] revision 8: gA backfilled D past head B"), out
    # A backfill that left before the next one came takes no room: C gone, D (25) leaves room for B.
    gone = [Event(7, K.queue_entry("gA", "C"), None), Event(8, K.shared_grant("gA", "C"), None),
            queued(9, "D"), backfill(10, "D", 9, 25)]
    assert check_backfills_spare_the_head(backfilled_past_b(*gone), K) == []
    # Judged on the earliest arrival: the head moved under a fresh key is still the head.
    moved = [put(7, K.moving("gA", "B"), {"job": "B", "since": 4}), Event(7, K.queue_entry("gA", "B"), None),
             queued(8, "B", since=4), Event(9, K.moving("gA", "B"), None), queued(10, "D"), backfill(11, "D", 10, 25)]
    events = [e for e in backfilled_past_b(*moved) if e.revision not in (30, 31, 32)]
    events[-1] = fit_grant(35, "B", 8, 40)
    assert check_backfills_spare_the_head(events, K)[0].startswith("[starve] revision 11")
    # An exclusive head admits no backfill at all.
    excl = backfilled_past_b()
    excl[-1] = put(35, K.shared_grant("gA", "B"), {"job": "B", "token": 31, "exclusive": True})
    assert "whole device" in check_backfills_spare_the_head(excl, K)[0]
