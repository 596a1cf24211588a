"""The parked-holder check (chaos_tests/holders.py) on hand-made etcd histories."""
from __future__ import annotations

import json

from chaos_tests.holders import Event, check_holders_not_parked
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
