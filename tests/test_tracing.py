"""One trace per handoff, in real processes: two jobs (the client library), two lockd replicas and
the node agent on the SIMULATED device, each exporting its spans to a file (TIMESLICE_TRACING=file:...).

A handoff with a swap is checked span by span: the job's ``timeslice.acquire`` is the root;
``lockd.acquire`` (the serving replica) continues it over gRPC metadata, with
``lockd.queue_wait`` under it; the leader's ``lockd.handoff`` joins through the queue entry,
with ``lockd.plan``, one ``lockd.intent`` per intent and ``lockd.grant``; the agent's
``nodeagent.snapshot``/``.restore`` spans, one per process, sit under the intent they
answered. Every span carries the job, group and token; each handoff is a trace of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the trace extra (opentelemetry-sdk) is not installed")

from timeslice.common.sim.device import SimDevice
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdCluster

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "examples" / "grpo" / "grpo_job.py"
NODE, GROUP, MiB = "trace-node", "traced", 1 << 20


def spans_in(folder: Path) -> list[dict]:
    out = []
    for p in folder.glob("spans-*.jsonl"):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.endswith("}")]
    return out


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never happened within {timeout}s: {what}")


@pytest.mark.slow
def test_a_handoff_with_a_swap_is_one_trace_from_the_job_through_lockd_to_the_agent(etcd, key_prefix, tmp_path):
    traced = {"TIMESLICE_TRACING": f"file:{tmp_path}/spans-{{pid}}.jsonl"}
    sim, host = tmp_path / "sim", tmp_path / "host"
    SimDevice(sim, host, capacity_bytes=64 * MiB)            # two 40 MiB jobs never fit: handoffs swap
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=2, logdir=str(tmp_path))
    for r in lockd.replicas:
        r.env.update(traced)
    lockd.start()
    agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), sim_dir=sim,
                         env={"TIMESLICE_SIM_HOST_DIR": str(host), **traced},
                         extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0"]).start()
    try:
        from timeslice import OrchestratorClient
        target = ",".join(lockd.targets)
        with OrchestratorClient(target, job_id="trace-admin") as admin:
            admin.create_group(GROUP, nodes=[NODE])
        env = {**os.environ, **traced, "TIMESLICE_TARGET": target, "TIMESLICE_NODE_NAME": NODE,
               "TIMESLICE_SIM_DIR": str(sim), "TIMESLICE_SIM_HOST_DIR": str(host), "TIMESLICE_AGENT_SOCKET": agent.socket}
        jobs = [subprocess.Popen([sys.executable, str(GRPO), "--group", GROUP, "--iterations", "1", "--phase-s", "0.1"],
                                 env={**env, "TIMESLICE_JOB_ID": job}, stdout=subprocess.PIPE, text=True)
                for job in ("trace-a", "trace-b")]
        for p in jobs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out

        def a_swapped_handoff_complete():
            spans = spans_in(tmp_path)
            for root in (s for s in spans if s["name"] == "timeslice.acquire" and s["attributes"].get(
                    "timeslice.restored") and s["attributes"].get("timeslice.bytes_moved", 0) > 0):
                mine = [s for s in spans if s["trace_id"] == root["trace_id"]]
                names = Counter(s["name"] for s in mine)
                if names["nodeagent.snapshot"] and names["nodeagent.restore"] and names["lockd.grant"]:
                    return root, mine, spans
            return None
        root, trace, spans = wait_for(a_swapped_handoff_complete, 30, "the spans of a handoff with a swap")
    finally:
        agent.stop()
        lockd.stop()

    by_id = {s["span_id"]: s for s in trace}
    job, token = root["attributes"]["timeslice.job"], root["attributes"]["timeslice.token"]

    def one(name: str, parent: dict) -> dict:
        got = [s for s in trace if s["name"] == name and s["parent_id"] == parent["span_id"]]
        assert len(got) == 1, (name, [(s["name"], s["parent_id"]) for s in trace])
        return got[0]

    def inside(child: dict, parent: dict, slack_ns: int = 5_000_000) -> bool:
        return parent["start_ns"] - slack_ns <= child["start_ns"] <= child["end_ns"] <= parent["end_ns"] + slack_ns

    # The job's span is the root; the serving replica continues it from the gRPC metadata.
    assert root["parent_id"] == "" and root["kind"] == "CLIENT" and root["service"] == "timeslice-job"
    assert root["attributes"]["timeslice.group"] == GROUP and root["attributes"]["timeslice.node"] == NODE
    served = one("lockd.acquire", root)
    assert served["kind"] == "SERVER" and served["service"] == "lockd" and inside(served, root)
    assert served["attributes"]["timeslice.token"] == token and served["attributes"]["timeslice.job"] == job
    wait = one("lockd.queue_wait", served)
    assert inside(wait, served)
    # The leader's handoff joins through the queue entry: plan, intents, grant.
    handoff = one("lockd.handoff", served)
    assert handoff["service"] == "lockd" and handoff["attributes"]["timeslice.token"] == token
    assert handoff["attributes"]["timeslice.restored"] is True and inside(handoff, served)
    plan = one("lockd.plan", handoff)
    grant = one("lockd.grant", handoff)
    intents = [s for s in trace if s["name"] == "lockd.intent"]
    assert {s["parent_id"] for s in intents} == {handoff["span_id"]}
    ops = {s["attributes"]["timeslice.op"]: s for s in intents}
    assert set(ops) == {"snapshot", "restore"}, intents
    assert ops["restore"]["attributes"]["timeslice.target_job"] == job
    assert ops["snapshot"]["attributes"]["timeslice.target_job"] != job
    assert all(s["attributes"]["timeslice.node"] == NODE and s["attributes"]["timeslice.outcome"] == "ok"
               for s in intents)
    assert plan["end_ns"] <= min(s["start_ns"] for s in intents) and grant["start_ns"] >= max(
        s["end_ns"] for s in intents) - 5_000_000
    # The agent's spans, one per process, under the intent each answered.
    for op, intent in ops.items():
        [moved] = [s for s in trace if s["name"] == f"nodeagent.{op}"]
        assert by_id[moved["parent_id"]] is intent and moved["service"] == "nodeagent"
        a = moved["attributes"]
        assert (a["timeslice.backend"], a["timeslice.gpus"], a["timeslice.bytes"], a["timeslice.outcome"]) == (
            "sim", "sim0", 40 * MiB, "done")
        assert a["timeslice.token"] == token and a["timeslice.node"] == NODE and a["timeslice.pid"] > 0
        assert a["timeslice.job"] == intent["attributes"]["timeslice.target_job"]
        assert inside(moved, intent)
    # Every span of the trace names the handoff, and each handoff is a trace of its own.
    assert all(s["attributes"].get("timeslice.token") == token for s in trace)
    assert {s["service"] for s in trace} == {"timeslice-job", "lockd", "nodeagent"}
    roots = [s for s in spans if s["name"] == "timeslice.acquire"]
    assert len({s["trace_id"] for s in roots}) == len(roots)
    handoffs = Counter(s["trace_id"] for s in spans if s["name"] == "lockd.handoff")
    assert all(n == 1 for n in handoffs.values()) and set(handoffs) <= {s["trace_id"] for s in roots}
