"""The leader's history of finished holds (lockd/history.py), sans-IO: mirror events in, writes out."""
from __future__ import annotations

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.common.server.etcd.watch import DELETE, PUT, WatchEvent
from timeslice.common.server.keys import Keys
from timeslice.lockd import history as H

K = Keys("/p/")


def kv(key: bytes, value: bytes = b"", rev: int = 1) -> rpc.KeyValue:
    return rpc.KeyValue(key=key, value=value, create_revision=rev, mod_revision=rev)


def put(key: bytes, rec: R.Record) -> WatchEvent:
    return WatchEvent(PUT, kv(key, rec.dump()), None)


def gone(key: bytes) -> WatchEvent:
    return WatchEvent(DELETE, kv(key), None)


def grant(job: str, token: int, ms: int, **kw) -> R.GrantValue:
    return R.GrantValue(job, token, 7, granted_ms=ms, **kw)


def answer(job: str, op: str, token: int, irev: int, nbytes: int = 10, ms: float = 5.0) -> R.StatusValue:
    return R.StatusValue(R.SNAPSHOTTED if op == R.SNAPSHOT else R.RUNNING, job, op=op, outcome=R.OK, group="g",
                         intent_revision=irev, token=token, bytes=nbytes, elapsed_ms=ms, gpu_bytes={"sim0": nbytes})


def test_a_finished_hold_becomes_one_record_with_its_wait_and_its_swap():
    book = H.HistoryBook(K)
    queue = {K.queue_entry("g", "a"): kv(K.queue_entry("g", "a"), R.QueueValue("a", enqueued_ms=900).dump())}
    book.reseed({}, 7, 1000)
    book.observe([put(K.grant("g"), grant("a", 10, 1000))], queue.get, 1000)
    assert not book.pending and book.open[("g", "a")].enqueued_ms == 900
    # b's swap: a snapshotted and b restored for b's grant (token 20), answered before it.
    book.observe([put(K.status("n1", "a"), answer("a", R.SNAPSHOT, 20, 101, 40)),
                  put(K.status("n1", "a"), answer("a", R.SNAPSHOT, 20, 101, 40)),      # a re-put: counted once
                  put(K.status("n1", "b"), answer("b", R.RESTORE, 20, 102, 40, 7.0))], queue.get, 1500)
    book.observe([gone(K.grant("g"))], queue.get, 1600)                             # a yields
    book.observe([put(K.grant("g"), grant("b", 20, 1700, restored=True, bytes_moved=80))], queue.get, 1700)
    book.observe([put(K.grant("g"), grant("a", 30, 2500))], queue.get, 2500)         # a direct handoff to a
    puts, deletes, taken = book.take()
    assert not deletes and [r.token for r in taken] == [10, 20]
    first, second = (R.HoldRecord.load(v) for _, v in puts)
    assert (first.job, first.granted_ms, first.released_ms, first.enqueued_ms, first.swaps) == ("a", 1000, 1600, 900, [])
    assert (second.job, second.released_ms, second.restored, second.bytes_moved) == ("b", 2500, True, 80)
    assert [(s["node"], s["job"], s["op"], s["bytes"], s["gpu_bytes"]) for s in second.swaps] == [
        ("n1", "a", R.SNAPSHOT, 40, {"sim0": 40}), ("n1", "b", R.RESTORE, 40, {"sim0": 40})]
    assert [k for k, _ in puts] == [K.history_entry("g", 10), K.history_entry("g", 20)]
    assert book.open[("g", "a")].token == 30


def test_records_are_bounded_per_group_and_in_all_oldest_first():
    book = H.HistoryBook(K, per_group=3, total=5)
    book.reseed({}, 1, 0)
    for i, (group, token) in enumerate([("g", 1), ("g", 2), ("h", 3), ("g", 4), ("g", 5), ("h", 6), ("h", 7)]):
        book.observe([put(K.grant(group), grant("j", token, i)), gone(K.grant(group))], lambda _k: None, i)
    puts, deletes, _ = book.take()
    assert len(puts) == 7
    # g keeps its newest 3 (1 goes); then 6 records in all is one too many: the oldest of all (2) goes.
    assert deletes == [K.history_entry("g", 1), K.history_entry("g", 2)]
    assert book.stored == {"g": [4, 5], "h": [3, 6, 7]}


def test_one_transaction_stays_within_etcds_operation_limit_and_a_failed_write_is_kept():
    book = H.HistoryBook(K, per_group=1)
    book.reseed({}, 1, 0)
    for t in range(1, 200):
        book.observe([put(K.grant("g"), grant("j", t, t)), gone(K.grant("g"))], lambda _k: None, t)
    puts, deletes, taken = book.take()
    assert len(puts) + len(deletes) <= H.MAX_TXN_OPS and len(taken) == len(puts)
    left = len(book.pending)
    book.give_back(taken)
    assert len(book.pending) == left + len(taken) and book.pending[0].token == 1
    assert book.stored["g"] == []               # nothing counted as stored that was not written


def test_reseed_picks_up_holds_in_progress_and_what_is_stored():
    book = H.HistoryBook(K)
    state = {K.grant("g"): kv(K.grant("g"), grant("a", 40, 500).dump()),
             K.history_entry("g", 12): kv(K.history_entry("g", 12), b"{}"),
             K.history_entry("h", 3): kv(K.history_entry("h", 3), b"{}")}
    book.reseed(state, 9, 600)
    assert book.epoch == 9 and book.open[("g", "a")].token == 40 and book.stored == {"g": [12], "h": [3]}
    # A new term whose mirror no longer has the grant: the hold ended while nobody led.
    book.reseed({}, 10, 800)
    assert [(r.token, r.released_ms) for r in book.pending] == [(40, 800)] and not book.open


def test_answers_for_a_grant_that_never_came_are_bounded():
    book = H.HistoryBook(K)
    book.reseed({}, 1, 0)
    for t in range(H.MAX_TOKENS_WITH_SWAPS + 10):
        book.observe([put(K.status("n", "j"), answer("j", R.SNAPSHOT, t + 1, t + 1))], lambda _k: None, 0)
    assert len(book.swaps) == H.MAX_TOKENS_WITH_SWAPS and min(book.swaps) == 11


def test_a_record_keeps_what_profiles_need_the_hint_the_jobs_own_hold_and_its_footprint():
    book = H.HistoryBook(K)
    state = {K.queue_entry("g", "a"): kv(K.queue_entry("g", "a"), R.QueueValue(
                 "a", device_bytes_hint=64, enqueued_ms=900, last_hold_ms=180).dump()),
             K.spec("g"): kv(K.spec("g"), R.GroupSpec(nodes=[{"node": "n1", "gpus": []}]).dump()),
             K.agent("n1"): kv(K.agent("n1"), R.AgentValue("n1", "sim", job_gpus={"a": {"sim0": 50}}).dump())}
    book.reseed({}, 7, 1000)
    book.observe([put(K.grant("g"), grant("a", 10, 1000))], state.get, 1000)
    book.observe([gone(K.grant("g"))], state.get, 1200)
    (_, raw), = book.take()[0]
    r = R.HoldRecord.load(raw)
    assert (r.hint_bytes, r.prev_busy_ms, r.gpu_bytes) == (64, 180, {"n1/sim0": 50})


def test_a_fit_groups_holders_each_become_a_record_of_their_own():
    book = H.HistoryBook(K)
    book.reseed({K.shared_grant("g", "a"): kv(K.shared_grant("g", "a"), grant("a", 10, 1000).dump())}, 3, 1000)
    b = R.GrantValue("b", 12, 1, granted_ms=1100, footprint={"n1/0": 5}, backfilled=True)
    book.observe([put(K.shared_grant("g", "b"), b)], lambda _k: None, 1100)         # b beside a
    assert sorted(book.open) == [("g", "a"), ("g", "b")]
    book.observe([gone(K.shared_grant("g", "b"))], lambda _k: None, 1500)             # b yields, a holds on
    book.observe([gone(K.shared_grant("g", "a"))], lambda _k: None, 1800)
    puts, _, taken = book.take()
    assert [(r.job, r.granted_ms, r.released_ms) for r in taken] == [("b", 1100, 1500), ("a", 1000, 1800)]
    stored = R.HoldRecord.load(puts[0][1])
    assert (stored.footprint, stored.backfilled, stored.exclusive) == ({"n1/0": 5}, True, False)
