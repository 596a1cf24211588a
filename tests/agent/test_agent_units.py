"""The agent's sans-IO pieces: decisions, fencing book, state derivation, configuration."""
from __future__ import annotations

import argparse

import pytest
from aetcd import rpc

from timeslice.common.errors import ConfigError
from timeslice.common.server import records as R
from timeslice.nodeagent import cli
from timeslice.nodeagent import config as C
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.backends.base import ProcState as S
from timeslice.nodeagent.inventory import differs
from timeslice.nodeagent.picture import Picture, job_state
from timeslice.nodeagent.tokens import TokenBook


def kv(value: bytes, rev: int = 7) -> rpc.KeyValue:
    return rpc.KeyValue(key=b"/p/nodes/n/intents/j", value=value, mod_revision=rev, create_revision=3)


def intent(op="snapshot", token=10, group="g", rev=7) -> I.Intent:
    return I.Intent.from_kv("j", kv(R.IntentValue(op, "j", group, token, 1).dump(), rev))


def test_job_state_follows_the_processes():
    assert job_state({}) == R.GONE
    assert job_state({1: S.GONE}) == R.GONE
    assert job_state({1: S.RUNNING, 2: S.GONE}) == R.RUNNING
    assert job_state({1: S.RUNNING, 2: S.CHECKPOINTED}) == R.SNAPSHOTTED   # half out cannot run
    assert job_state({1: S.LOCKED}) == R.FROZEN          # locked in place: runs nothing (strict groups)
    assert job_state({1: S.CHECKPOINTED, 2: S.FAILED}) == R.LOST
    assert job_state({1: S.NO_CUDA}) == R.RUNNING
    assert job_state({1: S.PARTIAL}) == R.SNAPSHOTTED          # regions released: restore before it runs
    # A process whose state cannot be read (a cooperative worker not reconnected since the agent
    # started) is never taken for running: it may have released regions.
    assert job_state({1: S.UNKNOWN}) == R.UNKNOWN
    assert job_state({1: S.RUNNING, 2: S.UNKNOWN}) == R.UNKNOWN


def test_a_partly_paused_job_is_parked_with_memory_left_on_the_device():
    pic = Picture({1: S.PARTIAL}, {1: 7}, {1: {"sim0": 7}}, {1: {"sim0": 13}})
    assert (pic.state, pic.partial, pic.resident_bytes, pic.resident_devices) == (R.SNAPSHOTTED, True, 13,
                                                                                  {"sim0": 13})
    assert (pic.device_bytes, pic.gpu_bytes) == (7, {"sim0": 7})     # the status: what a restore needs
    assert pic.needs(R.SNAPSHOT) and pic.needs(R.RESTORE)             # a further pause frees more
    whole = Picture({1: S.CHECKPOINTED}, {1: 20}, {1: {"sim0": 20}})
    assert not whole.partial and not whole.needs(R.SNAPSHOT)
    unknown = Picture({1: S.UNKNOWN}, left={1: {"sim0": 20}})
    assert (unknown.state, unknown.resident_devices) == (R.UNKNOWN, {"sim0": 20})


def test_an_unreachable_cooperative_worker_fails_the_op_with_the_reason_unless_nothing_is_to_do():
    why = "pid 1 of job 'j' is a cooperative worker that ... (--reconnect-grace-s)"
    d = I.decide(intent("restore"), Picture({1: S.UNKNOWN}), away=why)
    assert (d.kind, d.outcome, d.reason) == (I.REPORT, R.FAILED, why)
    d = I.decide(intent("snapshot"), Picture({1: S.CHECKPOINTED}, {1: 5}), away=why)
    assert d.outcome == R.OK                                           # paused already: nothing to move


def test_decisions():
    running = Picture({1: S.RUNNING}, {1: 5})
    snapped = Picture({1: S.CHECKPOINTED}, {1: 5})
    assert I.decide(intent(), running).kind == I.RUN
    d = I.decide(intent(), snapped)
    assert (d.kind, d.outcome) == (I.REPORT, R.OK) and "snapshotted already" in d.reason
    assert I.decide(intent("restore"), running).outcome == R.OK
    assert I.decide(intent("restore"), snapped).kind == I.RUN
    assert I.decide(intent(), Picture({1: S.GONE})).outcome == R.PROCESS_GONE
    d = I.decide(intent(), running, "stale_token: ...", 12)
    assert (d.kind, d.outcome, d.fence) == (I.REFUSE, R.REFUSED, 12)
    assert I.decide(intent("restore"), Picture({1: S.FAILED})).kind == I.RUN   # let the op say why


def test_unusable_intents_are_refused():
    assert "unknown op" in I.decide(intent("explode"), Picture()).reason
    assert "token" in I.decide(intent(token=0), Picture()).reason
    for raw in (b"{not json", b"[1, 2]", b'{"op": "snapshot"}'):
        bad = I.Intent.from_kv("j", kv(raw))
        assert bad.value is None and I.decide(bad, Picture()).outcome == R.REFUSED, raw


def test_a_status_answers_only_its_own_intent_once_finished():
    i = intent(rev=7)
    assert not I.answered(i, None)
    assert not I.answered(i, I.in_progress(i, Picture({1: S.RUNNING})))
    assert I.answered(i, I.status(i, R.SNAPSHOTTED, R.OK))
    assert not I.answered(intent(rev=8), I.status(i, R.SNAPSHOTTED, R.OK))
    refused = I.status(i, R.SNAPSHOTTED, R.REFUSED, token=99)
    assert refused.token == 99 and I.status(i, R.RUNNING, R.OK).token == 10


def test_corrections_keep_the_answer_and_fix_the_state():
    i = intent()
    st = I.status(i, R.SNAPSHOTTED, R.OK, device_bytes=5, pids=[1])
    assert I.corrected(st, Picture({1: S.CHECKPOINTED}, {1: 5})) is None
    gone = I.corrected(st, Picture({1: S.GONE}))
    assert (gone.state, gone.pids, gone.intent_revision, gone.outcome) == (R.GONE, [], 7, R.OK)
    assert I.corrected(I.in_progress(i, Picture({1: S.RUNNING})), Picture({1: S.GONE})) is None
    run = I.status(i, R.RUNNING, R.OK, device_bytes=5, pids=[1])
    assert I.corrected(run, Picture({1: S.RUNNING}, {1: 9})) is None      # allocator noise: not rewritten


def test_a_parked_jobs_residue_is_recorded_and_counted_only_while_parked():
    """The worker's own measure of what its pause left on the device reaches the job's status
    (and the metric) while it is parked; a running or fully checkpointed process has none."""
    from prometheus_client import CollectorRegistry

    from timeslice.nodeagent.channel import WorkerInfo
    from timeslice.nodeagent.metrics import Metrics
    w = WorkerInfo(pid=1, uid=0, job="j", tags={"weights": "offload"})
    w.update({"paused": ["weights"], "residue_bytes": 1234})
    assert w.residue_bytes == 1234
    w.update({"paused": ["weights"], "residue_bytes": True})          # not a count: ignored
    assert w.residue_bytes == 1234
    w.update({"paused": []})
    assert w.residue_bytes is None                                   # resumed: nothing is residue
    parked = Picture({1: S.CHECKPOINTED, 2: S.RUNNING}, {1: 10, 2: 20}, residue={1: 700, 2: 5})
    assert parked.residue_bytes == 700
    st = I.final(intent(), I_result(), parked, 1.0)
    assert (st.state, st.residue_bytes) == (R.SNAPSHOTTED, 700)
    assert R.StatusValue.load(st.dump()).residue_bytes == 700
    assert R.StatusValue.load(b'{"state": "running", "job": "j"}').residue_bytes == 0   # an older agent's
    m = Metrics(CollectorRegistry())
    m.note_residue({"j": 700})
    assert m.registry.get_sample_value("timeslice_agent_job_residue_bytes", {"job": "j"}) == 700
    m.note_residue({})
    assert m.registry.get_sample_value("timeslice_agent_job_residue_bytes", {"job": "j"}) is None


def I_result():
    from timeslice.nodeagent.backends import ops
    return ops.JobResult(R.SNAPSHOT, [ops.PidResult(1, ops.Outcome.DONE, S.RUNNING, S.CHECKPOINTED, bytes=10)])


def test_token_book_refuses_older_tokens_per_group_and_persists(tmp_path):
    path = tmp_path / "t.json"
    book = TokenBook(path)
    assert book.stale("g", 5) == ""
    assert book.note("g", 10) and not book.note("g", 9)
    assert "older than token 10" in book.stale("g", 9) and book.stale("g", 10) == "" and book.stale("h", 1) == ""
    assert TokenBook(path).highest("g") == 10
    fresh = TokenBook(tmp_path / "other.json")
    fresh.recover([R.StatusValue(R.SNAPSHOTTED, "j", group="g", token=12, outcome=R.OK),
                   R.StatusValue(R.RUNNING, "k", group="h", token=3, outcome=R.REFUSED),
                   R.StatusValue(R.RUNNING, "l", group="", token=50)])
    assert fresh.snapshot() == {"g": 12, "h": 3}


def test_agent_key_changes_that_matter():
    a = R.AgentValue("n", "sim", device_free_bytes=10, host_free_bytes=1 << 30, updated_ms=1)
    assert differs(None, a)
    assert not differs(a, R.AgentValue(**{**a.__dict__, "updated_ms": 2, "host_free_bytes": (1 << 30) + 1000}))
    assert differs(a, R.AgentValue(**{**a.__dict__, "host_free_bytes": 1 << 29}))
    assert differs(a, R.AgentValue(**{**a.__dict__, "device_free_bytes": 11}))
    assert differs(a, R.AgentValue(**{**a.__dict__, "job_device_bytes": {"j": 1}}))


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    return p.parse_args(argv)


def test_config_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("TIMESLICE_NODE_NAME", "gpu-7")
    monkeypatch.setenv("TIMESLICE_LOCK_TIMEOUT_MS", "250")
    monkeypatch.setenv("TIMESLICE_BACKEND", "cuda-checkpoint")
    cfg = C.from_args(_parse(["--prefix", "/x/", "--listen", "127.0.0.1:0"]))
    assert (cfg.node, cfg.lock_timeout_ms, cfg.backend_name, cfg.prefix) == ("gpu-7", 250, "cuda-cli", "/x/")
    assert cfg.reconnect_grace_s == 20.0
    assert cfg.endpoint(5000) == "127.0.0.1:5000"
    monkeypatch.setenv("TIMESLICE_NODE", "gpu-8")                       # the flag's own variable wins
    assert C.from_args(_parse([])).node == "gpu-8"
    assert C.from_args(_parse(["--node", "gpu-9"])).node == "gpu-9"  # and the flag wins over both
    drain = C.from_args(_parse(["--app-drain-s", "5", "--app-drain-expired", "abort"]))
    assert (drain.app_drain_s, drain.app_drain_expired) == (5.0, "abort")


@pytest.mark.parametrize("argv", [
    ["--backend", "gpu"], ["--prefix", "nope"], ["--lock-timeout-ms", "0"], ["--listen", "nohost"],
    ["--host-reserve-bytes", "-1"], ["--refresh-interval", "30"], ["--agent-lease-ttl", "1"],
    ["--sim-capacity-bytes", "0"], ["--log-level", "loud"], ["--sim-restore-gbps", "-2"],
    ["--reconnect-grace-s", "0"], ["--reconnect-grace-s", "601"],
    ["--app-drain-s", "-1"], ["--app-drain-s", "200", "--swap-deadline-s", "100"],
])
def test_invalid_settings_fail_at_start(argv):
    with pytest.raises(ConfigError):
        C.from_args(_parse(["--node", "n"] + argv))


def test_cli_exits_2_on_bad_configuration(capsys):
    assert cli.main(["serve", "--node", "bad/name"]) == 2
    assert "invalid configuration" in capsys.readouterr().err
    assert cli.main(["serve", "--node", "n", "--backend", "tpu"]) == 2


def test_the_agents_keys_are_spelled_and_parsed_by_common_keys():
    """The node's intent, status and worker keys are told apart by ``Keys`` alone: another
    node's, another prefix's, a malformed or non-UTF-8 key names no job."""
    from timeslice.common.server.keys import Keys
    k = Keys("/p/")
    assert k.node_workers("j", "n") == b"/p/jobs/j/workers/n/"
    assert k.worker("j", "n", 42) == b"/p/jobs/j/workers/n/42"
    assert k.intent_job(k.intent("n", "j"), "n") == "j" and k.intent_job(k.intent("m", "j"), "n") is None
    assert k.status_job(k.status("n", "j"), "n") == "j" and k.status_job(k.intent("n", "j"), "n") is None
    assert k.worker_of(k.worker("j", "n", 42), "n") == ("j", 42)
    assert k.worker_of(k.worker("j", "m", 42), "n") is None
    assert k.is_status(k.status("m", "j")) and not k.is_status(k.intent("m", "status"))
    assert not k.is_status(b"/p/groups/status/queue/status")   # a group or job named "status" is not a status
    for bad in (b"/q/nodes/n/intents/j", b"/p/nodes/n/intents/j/x", b"/p/jobs/j/workers/n/4x", b"/p/\xff/n"):
        assert k.intent_job(bad, "n") is None and k.worker_of(bad, "n") is None and k.status_job(bad, "n") is None


def test_a_further_snapshot_of_the_same_swap_counts_what_the_first_moved():
    """The residue's checkpoint (a second snapshot of the job in one swap) reports both moves: the
    leader reads one status per job for the grant's bytes_moved. Another swap's, a failed one's or
    an unfinished one's bytes are not added."""
    iv = R.IntentValue(R.SNAPSHOT, "c", "g", 9, 1, 0, isolation=R.ISOLATION_FULL)
    intent = I.Intent("c", 40, iv)
    done = R.StatusValue(R.SNAPSHOTTED, "c", op=R.SNAPSHOT, outcome=R.OK, group="g", token=9, bytes=12 << 20)
    assert I.moved_before(intent, done) == 12 << 20
    for other in ({"token": 8}, {"group": "h"}, {"outcome": R.FAILED}, {"outcome": ""}, {"op": R.RESTORE}):
        assert I.moved_before(intent, R.StatusValue(**{**done.__dict__, **other})) == 0, other
    assert I.moved_before(intent, None) == 0
    assert I.moved_before(I.Intent("c", 40, R.IntentValue(R.RESTORE, "c", "g", 9, 1, 0)), done) == 0
