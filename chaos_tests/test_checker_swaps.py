"""The checker's rules (swaprules.py, faultrules.py) each catch a violation planted in
a hand-made history and pass its well-behaved twin; the events they judge come from a real etcd
watch (the observer's sessions) and from the cooperative worker's own bookkeeping on the simulator."""
from __future__ import annotations

import argparse
import hashlib

from chaos_tests.checker import check
from chaos_tests.test_checker import ev, good_history, turn

S = 1000.0                      # ms per second (ev takes ms)


def section(t: float, job: str, token: int, pid: int, checked: bool | None = True, **granted) -> list[dict]:
    """acquire -> granted -> cs_start -> (data_check) -> cs_end -> yield, all of process ``pid``."""
    out = [ev(t, "acquire_req", job, pid=pid), ev(t + 1, "granted", job, token=token, pid=pid, **granted),
           ev(t + 1.2, "cs_start", job, token=token, pid=pid)]
    if checked is not None:
        out.append(ev(t + 2, "data_check", job, token=token, ok=checked, pid=pid))
    return [*out, ev(t + 5, "cs_end", job, token=token, pid=pid), ev(t + 6, "yield", job, token=token, pid=pid)]


# -- device ---------------------------------------------------------------------------------------
def test_a_grant_whose_device_bytes_go_unchecked_is_a_device_violation():
    filled = [ev(0, "acquire_req", "A", pid=1), ev(1, "granted", "A", token=10, pid=1),
              ev(1.2, "cs_start", "A", token=10, pid=1), ev(2, "device_fill", "A", pid=1, bytes=4),
              ev(5, "cs_end", "A", token=10, pid=1), ev(6, "yield", "A", token=10, pid=1)]
    assert check(filled + section(10, "A", 11, pid=1)).ok
    v = check(filled + section(10, "A", 11, pid=1, checked=None)).of_kind("device")
    assert len(v) == 1 and "A (pid 1) held token 11" in v[0]
    # Another process of the job that never filled its device owes no check; nor does a
    # section cut short, nor a process whose bytes were already found wrong (that is [data]).
    assert not check(filled + section(10, "A", 11, pid=2, checked=None)).of_kind("device")
    cut = [ev(10, "acquire_req", "A", pid=1), ev(11, "granted", "A", token=11, pid=1),
           ev(11.2, "cs_start", "A", token=11, pid=1), ev(12, "abandoned", "A")]
    assert not check(filled + cut).of_kind("device")
    failed = filled + section(10, "A", 11, pid=1, checked=False) + section(20, "A", 12, pid=1, checked=None)
    assert check(failed).of_kind("data") and not check(failed).of_kind("device")


# -- memory-back ----------------------------------------------------------------------------------
def test_a_grant_while_a_cooperative_region_is_paused_is_a_memory_back_violation():
    paused = [ev(3, "coop_paused", "A", None, tags=["kv"], pid=1),
              ev(3.5, "coop_paused", "A", None, tags=["weights"], pid=1)]
    bad = check(paused + section(10, "A", 11, pid=1)).of_kind("memory-back")
    assert len(bad) == 1 and "['kv', 'weights'] were paused" in bad[0]
    resumed = [*paused, ev(9, "coop_resumed", "A", None, tags=["kv", "weights"], pid=1)]
    assert check(resumed + section(10, "A", 11, pid=1)).ok
    partly = [*paused, ev(9, "coop_resumed", "A", None, tags=["weights"], pid=1)]
    assert "['kv']" in check(partly + section(10, "A", 11, pid=1)).of_kind("memory-back")[0]
    # Another process of the same job (a restart) has regions of its own.
    assert check(paused + section(10, "A", 11, pid=2)).ok


def test_a_grant_the_job_reports_without_its_memory_is_a_memory_back_violation():
    def report(back: bool, pid: int = 1) -> list[dict]:
        return [ev(1.3, "memory", "A", token=10, pid=pid, back=back, backend="checkpoint",
                   detail="process checkpointed on the simulated device")]
    assert check(section(0, "A", 10, pid=1) + report(True)).ok
    v = check(section(0, "A", 10, pid=1) + report(False)).of_kind("memory-back")
    assert len(v) == 1 and "process checkpointed" in v[0]
    # The ledger and the report seeing the same grant make one violation, not two.
    both = section(0, "A", 10, pid=1) + report(False) + [ev(0.5, "coop_paused", "A", None, tags=["w"], pid=1)]
    assert len(check(both).of_kind("memory-back")) == 1


# -- parked-orphan --------------------------------------------------------------------------------
def orphan_history(unparked_s: float | None, end_s: float = 60, faults: list[tuple[float, float]] = ()):
    """A parked from 2 s; its session ends at 10 s; unparked at ``unparked_s`` (None: never)."""
    out = [ev(0, "session_put", "A", None), ev(2 * S, "parked", "A", None, node="n1", state="snapshotted"),
           ev(10 * S, "session_end", "A", None), ev(end_s * S, "settled", None, None)]
    if unparked_s is not None:
        out.append(ev(unparked_s * S, "unparked", "A", None, node="n1"))
    for i, (t0, t1) in enumerate(faults):
        out += [ev(t0 * S, "fault", None, None, fault_id=i, what="agent killed"),
                ev(t1 * S, "heal", None, None, fault_id=i)]
    return out


def test_a_job_left_parked_without_a_session_is_a_parked_orphan_violation():
    assert not check(orphan_history(15), orphan_bound_s=10).of_kind("parked-orphan")
    v = check(orphan_history(25), orphan_bound_s=10).of_kind("parked-orphan")
    assert len(v) == 1 and "A: snapshotted on n1 without a live session from +10.000s until +25.000s" in v[0]
    # A fault active meanwhile pushes the deadline to its heal + the bound.
    assert not check(orphan_history(25, faults=[(12, 20)]), orphan_bound_s=10).of_kind("parked-orphan")
    assert check(orphan_history(35, faults=[(12, 20)]), orphan_bound_s=10).of_kind("parked-orphan")
    # Left parked at the end: a violation once the history ran past the deadline, not before.
    assert "to the end of the history" in check(orphan_history(None), orphan_bound_s=10).of_kind("parked-orphan")[0]
    assert not check(orphan_history(None, end_s=18), orphan_bound_s=10).of_kind("parked-orphan")
    # A new session of the job ends the orphan: parked with a live session is a parked job, no more.
    back = [*orphan_history(40), ev(12 * S, "session_put", "A", None)]
    assert not check(back, orphan_bound_s=10).of_kind("parked-orphan")


# -- recovery -------------------------------------------------------------------------------------
def recovery_history(grant_s: float | None, end_s: float = 60, more: list[tuple[float, float]] = ()):
    """A fault from 0 to 1 s; B asks at 2 s and is granted at ``grant_s`` (None: never)."""
    out = [ev(0, "fault", None, None, fault_id=0, what="agent killed"), ev(1 * S, "heal", None, None, fault_id=0),
           ev(2 * S, "acquire_req", "B"), ev(end_s * S, "settled", None, None)]
    if grant_s is not None:
        out += [ev(grant_s * S, "granted", "B", token=5), ev(grant_s * S + 1, "yield", "B", token=5)]
    else:
        out.append(ev(end_s * S - 1, "abandoned", "B"))
    for i, (t0, t1) in enumerate(more, start=1):
        out += [ev(t0 * S, "fault", None, None, fault_id=i, what="etcd majority lost"),
                ev(t1 * S, "heal", None, None, fault_id=i)]
    return out


def test_no_grant_within_the_bound_after_a_heal_is_a_recovery_violation():
    ok = check(recovery_history(20), recovery_bound_s=30)
    assert not ok.of_kind("recovery")
    assert ok.recoveries[0] == ("agent killed", 19.0, 19.0)
    v = check(recovery_history(40), recovery_bound_s=30).of_kind("recovery")
    assert len(v) == 1 and "after 'agent killed' healed" in v[0] and "only at" in v[0]
    assert "granted never" in check(recovery_history(None), recovery_bound_s=30).of_kind("recovery")[0]
    assert not check(recovery_history(None, end_s=20), recovery_bound_s=30).of_kind("recovery")
    # Another fault before the deadline pushes it to that fault's heal + the bound.
    assert not check(recovery_history(40, more=[(25, 35)]), recovery_bound_s=30).of_kind("recovery")
    # Nobody asking for a group after the heal: nothing to recover there.
    idle = [ev(0, "fault", None, None, fault_id=0, what="x"), ev(1 * S, "heal", None, None, fault_id=0),
            ev(90 * S, "acquire_req", "Z", "other"), ev(90 * S + 1, "granted", "Z", "other", token=3)]
    assert not check(idle, recovery_bound_s=30).of_kind("recovery")


def test_the_first_grant_after_a_heal_past_ten_seconds_is_a_heal_violation():
    assert not check(recovery_history(9)).of_kind("heal")            # 8 s after the heal (B asked at 2 s)
    v = check(recovery_history(14)).of_kind("heal")
    assert len(v) == 1 and "[heal] g: after 'agent killed' healed" in v[0] and "past 10s" in v[0]
    assert not check(recovery_history(14), heal_bound_s=None).of_kind("heal")   # a world that opts out
    assert "granted never" in check(recovery_history(None)).of_kind("heal")[0]
    # Measured from the heal of the last fault active before the deadline.
    assert not check(recovery_history(14, more=[(8, 10)])).of_kind("heal")


# -- quorum and status ----------------------------------------------------------------------------
def test_a_new_grant_while_etcd_has_no_majority_is_a_quorum_violation():
    gone = [ev(10 * S, "fault", None, None, fault_id=0, what="etcd majority lost", no_quorum=True),
            ev(20 * S, "heal", None, None, fault_id=0)]
    assert check(gone + turn(15 * S, "A", 10)).of_kind("quorum")
    assert not check(gone + turn(25 * S, "A", 10)).of_kind("quorum")
    # A grant written just before the majority went may reach its client a moment later.
    assert not check(gone + turn(10 * S, "A", 10)).of_kind("quorum")
    # The same grant returned again (a re-sent Acquire finding it) is no new grant.
    again = [*turn(5 * S, "A", 10), ev(15 * S, "acquire_req", "A"), ev(15 * S + 1, "granted", "A", token=10)]
    assert not check(gone + again).of_kind("quorum")


def test_an_internal_error_is_a_status_violation():
    assert check([*good_history(), ev(50, "error", "A", code="UNAVAILABLE", message="x")]).of_kind("status") == []
    v = check([*good_history(), ev(50, "error", "A", code="INTERNAL", message="etcd error UNKNOWN")]).of_kind("status")
    assert len(v) == 1 and "etcd error UNKNOWN" in v[0]


# -- the events themselves ------------------------------------------------------------------------
def test_the_observer_records_sessions_and_knows_the_orphans(etcd, tmp_path):
    import asyncio
    import json
    import time

    from chaos_tests.history import load_history
    from chaos_tests.observer import GrantObserver
    from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops

    prefix = f"/obs-sessions-{time.monotonic_ns()}/"

    async def put(key: str, val: dict | None) -> None:
        c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
        await c.connect()
        try:
            k = (prefix + key).encode()
            await c.txn([], [ops.put(k, json.dumps(val).encode()) if val is not None else ops.delete(k)])
        finally:
            await c.close()

    def until(pred) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, load_history(str(tmp_path))
            time.sleep(0.02)

    obs = GrantObserver(etcd.endpoints_str, prefix, str(tmp_path)).start()
    try:
        asyncio.run(put("jobs/PX/session", {"lease": 1}))
        asyncio.run(put("nodes/n1/status/PX", {"state": "snapshotted"}))
        until(lambda: obs.states.get(("n1", "PX")) == "snapshotted")
        assert obs.orphans() == [] and obs.in_state({"snapshotted"}) == [("n1", "PX")]
        asyncio.run(put("jobs/PX/session", None))
        until(lambda: obs.orphans() == [("n1", "PX")])
        asyncio.run(put("nodes/n1/status/PX", {"state": "running"}))
        until(lambda: obs.orphans() == [])
    finally:
        obs.stop()
    got = [e["ev"] for e in load_history(str(tmp_path))]
    assert got == ["session_put", "parked", "session_end", "unparked"]


def test_the_cooperative_worker_checks_its_regions_bytes_after_a_resume(tmp_path):
    """Offload regions must come back bit-exact, discard regions zeroed; a byte changed behind the
    job's back (as a bad restore would) fails the job's data check; a released region fails it too."""
    from chaos_tests.coopdevice import RecordingCoopMemory, SimCoopWorkerDevice
    from chaos_tests.history import HistoryRecorder, load_history
    from timeslice.common.sim.device import SimDevice

    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=16 << 20)
    rec = HistoryRecorder(str(tmp_path / "h"), name="client-A", job="A")
    a = argparse.Namespace(coop_regions="weights:65536:offload,kv:32768:discard", sim_dir=str(tmp_path / "sim"),
                           seed=3, device_timeout=2.0, job="A", node="n1", agent_socket=None, rpc_timeout=0.5)
    dev = SimCoopWorkerDevice(a, job=None, rec=rec)  # type: ignore[arg-type]
    dev.mem = RecordingCoopMemory(dev.regions, a.sim_dir, a.seed, rec)
    dev.expected = {t: dev.mem.expected(t) for t in dev.regions}
    dev._check_and_stamp("g", 7)                       # as filled
    dev.mem.pause(["weights"])
    dev.mem.pause(["kv"])
    assert dev.mem.released() == ["kv", "weights"]
    dev._check_and_stamp("g", 8)                       # released in a "granted" section
    dev.mem.resume(["weights", "kv"])
    dev._check_and_stamp("g", 9)                       # weights bit-exact, kv zeroed
    with dev.mem.compute("weights") as view:           # a byte changed behind the job's back
        view[100] ^= 0xFF
    dev._check_and_stamp("g", 10)
    rec.close()
    checks = [(e["token"], e["ok"], e["detail"]) for e in load_history(str(tmp_path / "h")) if e["ev"] == "data_check"]
    assert [ok for _, ok, _ in checks] == [True, False, True, False], checks
    assert "released in a granted section" in checks[1][2]
    assert checks[3][2].startswith("weights: sha256") and "kv" not in checks[3][2]
    with dev.mem.compute("kv") as view:                # the discard region came back zeroed, then stamped
        assert hashlib.sha256(view).hexdigest() == dev.expected["kv"]
    evs = [e["ev"] for e in load_history(str(tmp_path / "h")) if e["ev"].startswith("coop_")]
    assert evs == ["coop_pausing", "coop_paused", "coop_pausing", "coop_paused", "coop_resuming", "coop_resumed"]


# -- the fenced resource survives a process killed while it writes --------------------------------
def _die_while_saving(path: str, hist: str) -> None:
    """Apply one operation, then die (os._exit, as SIGKILL would) in the middle of saving the next."""
    import json
    import os

    from chaos_tests import history
    from chaos_tests.history import FencedResource, HistoryRecorder

    fence = FencedResource(path)
    rec = HistoryRecorder(hist, name="dying", job="D")
    fence.apply(rec, "g", 5)

    class Dying:
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(*_a, **_kw):
            os._exit(9)

    history.json = Dying  # type: ignore[assignment]
    fence.apply(rec, "g", 6)


def test_a_process_killed_while_the_fence_saves_leaves_its_state_whole(tmp_path):
    """A chaos client SIGKILLed inside its fenced operation must not wipe the resource's state: on
    main before this fix the file was truncated before the new state was written, so a death in
    between reset every job's operation count and the highest token (seen in a fault run: every job's
    count on g0 dropped to 1 at once, then a data check failed, 'expected 194 ops, resource has 168')."""
    import multiprocessing

    from chaos_tests.history import FencedResource, HistoryRecorder

    path, hist = str(tmp_path / "gpu"), str(tmp_path / "h")
    fence = FencedResource(path)
    rec = HistoryRecorder(hist, name="other", job="O")
    assert fence.apply(rec, "g", 3)
    p = multiprocessing.get_context("spawn").Process(target=_die_while_saving, args=(path, hist))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    assert (fence.ops("g", "O"), fence.ops("g", "D")) == (1, 1)
    assert not fence.apply(rec, "g", 4)            # the highest token (5) survived: 4 is refused
    rec.close()
