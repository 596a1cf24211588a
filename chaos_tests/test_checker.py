"""The checker catches each kind of violation in hand-made histories and passes a good one;
the recorder, loader and fenced resource produce histories it can judge."""
from __future__ import annotations

import multiprocessing
import random

import pytest

from chaos_tests.checker import check
from chaos_tests.history import FencedResource, HistoryRecorder, load_history

MS = 1_000_000


def ev(t_ms: float, kind: str, job: str, group: str = "g", **fields) -> dict:
    return {"ev": kind, "t": int(t_ms * MS), "job": job, "group": group, **fields}


def turn(t: float, job: str, token: int, group: str = "g", queued_at: float | None = None):
    """A complete, well-behaved turn: request, grant, fenced section, yield."""
    req = t if queued_at is None else queued_at
    return [ev(req, "acquire_req", job, group), ev(req + 0.1, "enqueued", job, group, token=token),
            ev(t + 1, "granted", job, group, token=token),
            ev(t + 1.1, "fence_ok", job, group, token=token),
            ev(t + 1.2, "cs_start", job, group, token=token),
            ev(t + 5, "fence_ok", job, group, token=token),
            ev(t + 5.1, "cs_end", job, group, token=token),
            ev(t + 6, "yield", job, group, token=token)]


def good_history() -> list[dict]:
    # B queues while A holds; A then queues again behind B; a second group runs beside.
    return (turn(0, "A", 10) + turn(10, "B", 12, queued_at=2) + turn(20, "A", 15, queued_at=12)
            + turn(0, "C", 11, group="h")
            + [ev(40, "data_check", "A", ok=True), ev(40, "data_check", "B", ok=True)])


def test_good_history_passes_in_any_order():
    events = good_history()
    random.Random(7).shuffle(events)
    report = check(events, expected_order={"g": ["A", "B", "A"], "h": ["C"]})
    assert report.ok, report.violations
    assert (report.grants, report.groups, report.jobs, report.acquires) == (4, 2, 3, 4)
    assert report.critical_sections == 4
    assert report.max_grant_gap_s == pytest.approx(0.010)
    assert report.max_wait_s == pytest.approx(0.009)


def test_overlapping_sections_are_a_mutex_violation():
    events = turn(0, "A", 10) + turn(3, "B", 12, queued_at=1)  # B enters at 4.2, A leaves at 5.1
    assert check(events).of_kind("mutex")


def test_section_fenced_off_after_lease_loss_is_not_a_violation():
    # A pauses inside its section, loses its lease; B is granted and fences A off.
    events = [ev(0, "acquire_req", "A"), ev(1, "granted", "A", token=10),
              ev(1.1, "cs_start", "A", token=10), ev(1.2, "fence_ok", "A", token=10),
              ev(2, "acquire_req", "B"), ev(20, "granted", "B", token=12),
              ev(20.1, "fence_ok", "B", token=12), ev(20.2, "cs_start", "B", token=12),
              ev(25, "fence_reject", "A", token=10, highest=12), ev(25.1, "cs_end", "A", token=10),
              ev(26, "error", "A", message="session lost"),
              ev(30, "fence_ok", "B", token=12), ev(30.1, "cs_end", "B", token=12)]
    report = check(events)
    assert report.ok, report.violations
    assert (report.fence_rejections, report.fenced_sections, report.errors) == (1, 1, 1)


def test_stale_token_accepted_by_the_fence_is_a_violation():
    events = [ev(0, "acquire_req", "A"), ev(1, "granted", "A", token=10),
              ev(1.1, "cs_start", "A", token=10),
              ev(2, "acquire_req", "B"), ev(20, "granted", "B", token=12),
              ev(20.1, "fence_ok", "B", token=12), ev(20.2, "cs_start", "B", token=12),
              ev(25, "fence_ok", "A", token=10), ev(25.1, "cs_end", "A", token=10),
              ev(30, "cs_end", "B", token=12)]
    report = check(events)
    assert report.of_kind("stale-token")
    assert report.of_kind("mutex")


def test_section_with_a_token_the_job_does_not_hold():
    events = [ev(0, "acquire_req", "A"), ev(1, "granted", "A", token=10),
              ev(2, "cs_start", "A", token=9), ev(3, "cs_end", "A", token=9)]
    assert check(events).of_kind("stale-token")


def test_tokens_going_back_in_grant_order():
    events = turn(0, "A", 10, queued_at=0) + turn(10, "B", 8, queued_at=0.05)
    [violation] = check(events).of_kind("token-order")
    assert "B was overtaken" in violation


def _yield_failed(t: float, job: str, token: int) -> list[dict]:
    """A turn whose Yield failed (an etcd majority loss outlasted the call): the job still holds ``token``."""
    return [ev(t, "acquire_req", job), ev(t + 1, "granted", job, token=token),
            ev(t + 1.2, "cs_start", job, token=token), ev(t + 2, "cs_end", job, token=token),
            ev(t + 3, "error", job, token=token, message="DeadlineError")]


def test_a_hold_kept_through_a_failed_yield_granted_again_is_no_token_going_back():
    # The long run (seed 3310, up timings): c4's Yield of 18513 failed in a majority loss; its next
    # Acquire, once etcd was back, returned 18513 (the hold it kept). The same grant, not a new one.
    events = _yield_failed(0, "A", 10) + turn(20, "A", 10) + turn(40, "B", 12, queued_at=30)
    report = check(events)
    assert report.ok, report.violations


def test_a_kept_token_granted_again_after_another_job_held_the_group_is_a_token_order_violation():
    events = _yield_failed(0, "A", 10) + turn(10, "B", 12) + turn(30, "A", 10)
    [violation] = check(events).of_kind("token-order")
    assert "A granted token 10" in violation


def test_a_token_granted_again_after_its_yield_went_through_is_a_token_order_violation():
    events = turn(0, "A", 10) + turn(10, "A", 10)
    assert check(events).of_kind("token-order")


def test_token_not_following_request_order_is_a_fifo_violation():
    # A was queued (token 20) before B even asked, yet B got the smaller token 15.
    events = [ev(0, "acquire_req", "A"), ev(1, "enqueued", "A", token=20),
              ev(2, "acquire_req", "B"), ev(3, "granted", "B", token=15),
              ev(4, "yield", "B", token=15), ev(5, "granted", "A", token=20)]
    assert check(events).of_kind("fifo")


def test_expected_order_is_enforced():
    events = turn(0, "A", 10) + turn(10, "B", 12, queued_at=2)
    assert check(events, expected_order=["A", "B"]).ok
    assert check(events, expected_order=["B", "A"]).of_kind("fifo")
    assert check(events, expected_order={"g": ["B", "A"]}).of_kind("fifo")


@pytest.mark.parametrize("ending,ok", [(None, False), ("error", True), ("abandoned", True)])
def test_every_waiter_is_resolved(ending, ok):
    events = turn(0, "A", 10) + [ev(2, "acquire_req", "B")]
    if ending:
        events.append(ev(50, ending, "B", message="gave up"))
    report = check(events)
    assert report.ok is ok and bool(report.of_kind("lost-waiter")) is not ok
    assert report.abandoned == (ending == "abandoned")


def test_second_request_before_the_first_resolved_loses_a_waiter():
    events = [ev(0, "acquire_req", "A"), ev(1, "acquire_req", "A"), ev(2, "granted", "A", token=5)]
    assert check(events).of_kind("lost-waiter")


def test_failed_data_check():
    events = turn(0, "A", 10) + [ev(9, "data_check", "A", ok=False, detail="3 of 4 ops")]
    assert check(events).of_kind("data") == ["[data] g: A at +0.009s: 3 of 4 ops"]


def test_protocol_breaches():
    events = [ev(0, "granted", "A", token=3), ev(1, "cs_start", "A", token=3),
              ev(2, "acquire_req", "B"), ev(3, "granted", "B", token=4), ev(4, "cs_end", "B", token=4)]
    kinds = check(events).of_kind("protocol")
    assert any("without acquire_req" in v for v in kinds)
    assert any("never ended" in v for v in kinds)
    assert any("cs_end without" in v for v in kinds)


def test_empty_history_is_ok():
    assert check([]).ok


def test_recorder_loader_and_fence_round_trip(tmp_path):
    fence = FencedResource(str(tmp_path / "gpu"))
    a = HistoryRecorder(str(tmp_path / "h"), name="client-a", job="A")
    b = HistoryRecorder(str(tmp_path / "h"), name="client-b", job="B")
    a.acquire_req("g"), a.granted("g", 10), a.cs_start("g", 10)
    assert fence.apply(a, "g", 10)
    b.acquire_req("g"), b.granted("g", 12)
    assert fence.apply(b, "g", 12)
    b.cs_start("g", 12)
    assert not fence.apply(a, "g", 10)  # A was deposed: fenced off
    a.cs_end("g", 10), a.error("g", "session lost")
    assert fence.apply(b, "g", 12)
    b.cs_end("g", 12), b.yielded("g", 12)
    assert fence.verify(b, "g", 2) and not fence.verify(a, "g", 2)
    a.close(), b.close()
    with open(b.path, "a") as f:
        f.write('{"ev": "cs_st')  # a writer killed mid-line
    events = load_history(str(tmp_path / "h"))
    report = check(events)
    assert report.of_kind("data") and len(report.violations) == 1, report.violations
    assert (report.grants, report.fence_rejections, report.fenced_sections) == (2, 1, 1)


def test_loader_refuses_corruption_in_the_middle(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"ev": "acquire_req", "t": 1}\nnot json\n{"t": 2}\n')
    with pytest.raises(ValueError, match="corrupt"):
        load_history(str(tmp_path))


def _hammer(path: str, directory: str, job: str, token: int, n: int) -> None:
    rec = HistoryRecorder(directory, name=job, job=job)
    fence = FencedResource(path)
    for _ in range(n):
        fence.apply(rec, "g", token)
    rec.close()


def test_fence_serialises_processes(tmp_path):
    path, hist = str(tmp_path / "gpu"), str(tmp_path / "h")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(path, hist, job, tok, 200))
             for job, tok in (("old", 5), ("new", 7))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = load_history(hist)
    oks = [e for e in events if e["ev"] == "fence_ok"]
    assert [e["token"] for e in oks] == sorted(e["token"] for e in oks)  # never back to 5
    rejects = sum(e["ev"] == "fence_reject" for e in events)
    assert len(oks) + rejects == 400
    assert FencedResource(path).ops("g", "new") == 200
    assert check(events).fence_rejections == rejects


# -- grants nobody claimed, false session loss (claims.py) ----------------------
def grant_put(t_ms, job, token, group="g", **fields):
    return ev(t_ms, "grant_put", job, group, token=token, **fields)


def test_ghost_grant_is_a_violation_and_claimed_or_released_grants_are_not():
    S = 1000.0                                          # ms per second
    claimed = turn(0, "A", 10) + [grant_put(0.5, "A", 10), ev(7, "grant_end", "A", token=10)]
    # B's grant is written but its call ended CANCELLED; the grant stays 30 s.
    ghost = [ev(10, "acquire_req", "B"), grant_put(11, "B", 12),
             ev(12, "error", "B", message="CANCELLED"), ev(30 * S, "grant_end", "B", token=12)]
    report = check(claimed + ghost, ghost_bound_s=5)
    assert len(report.of_kind("ghost")) == 1 and "token 12 to B" in report.of_kind("ghost")[0]
    # Released within the bound (a killed holder's lease expired): fine.
    expired = [ev(10, "acquire_req", "B"), grant_put(11, "B", 12), ev(12, "abandoned", "B"),
               ev(4 * S, "grant_end", "B", token=12)]
    assert check(claimed + expired, ghost_bound_s=5).of_kind("ghost") == []
    # The same grant rewritten (same token) keeps its start; a grant claimed late is still a ghost.
    late = [ev(10, "acquire_req", "B"), grant_put(11, "B", 12), grant_put(2 * S, "B", 12),
            ev(12, "error", "B"), ev(20 * S, "acquire_req", "B"), ev(20 * S + 1, "granted", "B", token=12),
            ev(20 * S + 2, "yield", "B", token=12), grant_put(20 * S + 2, "C", 13)]
    assert len(check(claimed + late, ghost_bound_s=5).of_kind("ghost")) == 1
    # A grant written after the job's last acquire had returned: a stale attempt's, even
    # though the job's next acquire finds it (and yields it at once).
    stale = turn(0, "A", 10) + [grant_put(0.5, "A", 10), ev(7, "grant_end", "A", token=10),
                                grant_put(8, "A", 14), ev(9, "acquire_req", "A"),
                                ev(9.5, "granted", "A", token=14), ev(10, "yield", "A", token=14),
                                ev(10, "grant_end", "A", token=14)]
    v = check(stale, ghost_bound_s=5).of_kind("ghost")
    assert len(v) == 1 and "nobody waits for" in v[0]
    # A grant still open when the history ends is judged only once the bound has passed.
    assert check(claimed + [grant_put(8, "B", 12)], ghost_bound_s=5).of_kind("ghost") == []


def test_a_grant_the_observer_was_told_late_is_judged_by_etcds_order_not_its_delivery_time():
    """CI's etcd quorum-loss run: the observer's watch re-opened after the majority came back and
    delivered an earlier attempt's grant (token 56, written at revision 60, released at 61) after the
    job's next acquire had already returned token 95 (entry created at revision 95). Written before
    that entry existed, it cannot have been written after the acquire returned; by delivery time
    alone it looked so."""
    S = 1000.0
    earlier = [ev(0, "acquire_req", "A"), ev(2 * S, "error", "A", message="session lost")]
    told_late = earlier + [ev(3 * S, "acquire_req", "A"), ev(3 * S + 5, "granted", "A", token=95),
                           grant_put(3 * S + 50, "A", 56, rev=60), ev(3 * S + 51, "grant_end", "A", token=56, rev=61),
                           grant_put(3 * S + 52, "A", 95, rev=97), ev(3 * S + 60, "yield", "A", token=95),
                           ev(3 * S + 61, "grant_end", "A", token=95, rev=98)]
    assert check(told_late, ghost_bound_s=5).of_kind("ghost") == []
    # The same delivery with a revision after the returned entry's: a stale attempt's grant, a ghost.
    stale = [dict(e, rev=99) if e["ev"] == "grant_put" and e["token"] == 56 else e for e in told_late]
    v = check(stale, ghost_bound_s=5).of_kind("ghost")
    assert len(v) == 1 and "token 56" in v[0] and "nobody waits for" in v[0]


def test_session_loss_while_the_lease_is_alive_is_a_violation():
    ok = [ev(1, "session_lost", "A", group=None, lease=7, lease_ttl_left=-1),
          ev(2, "session_lost", "B", group=None, lease=8, lease_ttl_left=1)]
    assert check(good_history() + ok).of_kind("session-loss") == []
    bad = [ev(3, "session_lost", "C", group=None, lease=9, lease_ttl_left=4)]
    v = check(good_history() + bad).of_kind("session-loss")
    assert len(v) == 1 and "C" in v[0] and "4s" in v[0]


def test_session_loss_judged_by_what_etcd_did_with_the_lease_afterwards():
    """etcd had no majority when the client declared the loss (nobody could say how long the lease had
    left); the observer's record of the lease's session key says it afterwards."""
    put = [ev(0, "session_put", "A", group=None, lease=7)]
    told = [ev(10_000, "session_lost", "A", group=None, lease=7, lease_ttl_left=None)]
    expired = [ev(9_800, "session_end", "A", group=None, lease=7)]            # gone before the word
    assert check(good_history() + put + told + expired).of_kind("session-loss") == []
    late = [ev(10_500, "session_end", "A", group=None, lease=7)]              # within the slack
    assert check(good_history() + put + told + late).of_kind("session-loss") == []
    kept = [ev(17_000, "session_end", "A", group=None, lease=7)]              # etcd held it 7 s more
    v = check(good_history() + put + told + kept).of_kind("session-loss")
    assert len(v) == 1 and "lease 7" in v[0] and "7.0s later" in v[0]
    end = [ev(20_000, "settled", None, None)]                                 # never deleted at all
    v = check(good_history() + put + told + end).of_kind("session-loss")
    assert len(v) == 1 and "at the end of the history" in v[0]


def test_a_holder_parked_on_its_groups_devices_is_a_cross_group_violation():
    """PX holds gA (GPU 0 of n1); gB (GPU 1) hands over; PX must never be parked on GPU 0."""
    specs = [ev(0, "group_spec", None, "gA", nodes=[{"node": "n1", "gpus": [0]}]),
             ev(0, "group_spec", None, "gB", nodes=[{"node": "n1", "gpus": [1]}])]
    held = [ev(10, "grant_put", "PX", "gA", token=5), ev(30, "grant_end", "PX", "gA", token=5)]

    def parked(t0, t1, gpus, state="snapshotting", job="PX"):
        return [ev(t0, "parked", job, None, node="n1", gpus=gpus, state=state),
                ev(t1, "unparked", job, None, node="n1")]

    bad = check(specs + held + parked(20, 40, [0]))
    assert bad.of_kind("cross-group") and "PX: snapshotting on n1 GPUs [0]" in bad.of_kind("cross-group")[0]
    assert check(specs + held + parked(20, 25, [], state="frozen")).of_kind("cross-group")   # unknown GPUs: all
    assert check(specs + held + parked(5, 12, [0], state="restoring")).of_kind("cross-group")  # granted mid-restore
    assert not check(specs + held + parked(20, 40, [1])).of_kind("cross-group")       # another group's GPU
    assert not check(specs + held + parked(31, 40, [0])).of_kind("cross-group")       # after the yield
    assert not check(specs + held + parked(2, 9, [0])).of_kind("cross-group")         # restored before the grant
    assert not check(specs + held + parked(20, 40, [0], job="PY")).of_kind("cross-group")
    # Without the observer's grants, the client's granted ... yield is the hold.
    client_held = [ev(9, "acquire_req", "PX", "gA"), ev(10, "granted", "PX", "gA", token=5),
                   ev(30, "yield", "PX", "gA", token=5)]
    assert check(specs + client_held + parked(20, 40, [0])).of_kind("cross-group")
    assert not check(specs + client_held + parked(31, 40, [0])).of_kind("cross-group")


def test_the_observer_records_specs_and_parkings_from_etcd(etcd, tmp_path):
    """The cross-group rule's events come from a real etcd watch (observer.py), in revision order."""
    import asyncio
    import json
    import time

    from chaos_tests.observer import GrantObserver
    from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops

    prefix = "/obs-test/"

    async def writes():
        c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
        await c.connect()
        try:
            for key, val in [("groups/gA/spec", {"nodes": [{"node": "n1", "gpus": [0]}]}),
                             ("nodes/n1/agent", {"gpus": [{"index": 0, "uuid": "sim0"}, {"index": 1, "uuid": "sim1"}]}),
                             ("groups/gA/grant", {"job": "PX", "token": 5}),
                             ("nodes/n1/status/PX", {"state": "snapshotting", "gpu_bytes": {"sim0": 9}}),
                             ("nodes/n1/status/PX", {"state": "snapshotted", "gpu_bytes": {"sim0": 9}}),
                             ("nodes/n1/status/PX", {"state": "running", "gpu_bytes": {"sim0": 9}})]:
                await c.txn([], [ops.put((prefix + key).encode(), json.dumps(val).encode())])
            await c.txn([], [ops.delete((prefix + "groups/gA/grant").encode())])
        finally:
            await c.close()

    obs = GrantObserver(etcd.endpoints_str, prefix, str(tmp_path)).start()
    asyncio.run(writes())
    deadline = time.monotonic() + 10
    while not any(e["ev"] == "grant_end" for e in load_history(str(tmp_path))):
        assert time.monotonic() < deadline, load_history(str(tmp_path))
        time.sleep(0.05)
    obs.stop()
    got = [(e["ev"], e.get("job"), e.get("gpus"), e.get("state")) for e in load_history(str(tmp_path))]
    assert got == [("group_spec", None, None, None), ("grant_put", "PX", None, None),
                   ("parked", "PX", [0], "snapshotting"), ("parked", "PX", [0], "snapshotted"),
                   ("unparked", "PX", None, None), ("grant_end", "PX", None, None)]
    assert check(load_history(str(tmp_path))).of_kind("cross-group")       # PX was parked while holding gA
