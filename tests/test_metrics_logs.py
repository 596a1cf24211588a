"""Metrics and logs to convention, on a real local cluster (etcd, 2 lockd replicas, a
simulated-device agent started by the product's launcher).

Every metric endpoint is scraped after some lock traffic: names carry the
project prefix and their unit, counters end in ``_total``, one meaning has one
name (no family exported by both lockd and the agent), buckets reach the
longest acquire wait, build info and process metrics are there, deleted groups
leave no ``queue_depth`` series, and the endpoints listen on loopback only.
Every line lockd and the agent write is a JSON object (the ready lines too)
naming its replica or node, with no Python bytes repr.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.settings import Settings

# Gauges whose value has no unit (a count, a 0/1 state).
UNITLESS_GAUGES = {"timeslice_queue_depth", "timeslice_is_leader", "timeslice_etcd_connected",
                   "timeslice_agent_etcd_connected", "timeslice_agent_ops_in_flight"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cluster")
    s = Settings(etcd_members=1, lockd_replicas=2, backend="sim", sim_device_capacity_bytes=16 << 20)
    c = LocalCluster(s, run_dir, node="n1", group="g-live", progress=lambda _m: None,
                     sim_dir=str(run_dir / "sim")).start()
    try:
        from timeslice import OrchestratorClient
        with OrchestratorClient(c.target, job_id="metrics-job", timeout=30) as client:
            client.acquire("g-live", timeout=30)
            client.yield_("g-live")
            for i in range(20):                       # groups that come and go
                client.create_group(f"gone-{i}", nodes=["n1"])
                client.delete_group(f"gone-{i}")
        yield c
    finally:
        c.stop(quiet=True)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def endpoints(c: LocalCluster) -> dict[str, int]:
    eps = {f"lockd-{r.name}": r.info["metrics_port"] for r in c.lockd}
    eps["nodeagent"] = c.agent.info["metrics_port"]
    return eps


def naming_problems(fams: dict) -> list[str]:
    out = []
    for name, f in fams.items():
        if name.startswith(("process_", "grpc_server_")):   # the conventional names of those
            continue
        if not name.startswith("timeslice_"):
            out.append(f"{name}: not under timeslice_")
        if re.search(r"_(ms|millis|milliseconds|kb|mb|gb|percent)(_|$)", name):
            out.append(f"{name}: use base units (seconds, bytes, ratio)")
        if "seconds" in name and not name.endswith("_seconds"):
            out.append(f"{name}: the unit must be the last word")
        if "bytes" in name and not name.endswith("_bytes"):
            out.append(f"{name}: the unit must be the last word")
        if f.type == "histogram" and not name.endswith(("_seconds", "_bytes")):
            out.append(f"{name}: a histogram without a unit")
        if f.type == "gauge" and name not in UNITLESS_GAUGES and not name.endswith("_info") and not name.endswith(("_bytes", "_seconds", "_ratio")):
            out.append(f"{name}: gauge without a unit suffix (or add it to UNITLESS_GAUGES)")
        if f.type == "counter" and not all(s.name.endswith("_total") for s in f.samples):
            out.append(f"{name}: counter samples must end in _total")
        if not f.documentation:
            out.append(f"{name}: no HELP")
    return out


def test_every_endpoint_follows_the_naming_convention(cluster):
    for who, port in endpoints(cluster).items():
        problems = naming_problems(families(scrape(port)))
        assert problems == [], f"{who}:\n" + "\n".join(problems)


def test_no_meaning_exported_twice(cluster):
    eps = endpoints(cluster)
    lockd = families(scrape(eps["lockd-r0"]))
    agent = families(scrape(eps["nodeagent"]))
    shared = {n for n in set(lockd) & set(agent)
              if not n.startswith(("process_", "grpc_server_")) and n != "timeslice_build_info"}
    assert shared == set(), f"exported by lockd and the agent: {sorted(shared)}"
    ours = lambda n: n.startswith("timeslice_") and n != "timeslice_build_info"
    helps = {f.documentation for n, f in lockd.items() if ours(n)}
    assert not [n for n, f in agent.items() if ours(n) and f.documentation in helps]


def test_build_info_process_metrics_and_long_buckets(cluster):
    for who, port in endpoints(cluster).items():
        fams = families(scrape(port))
        info = fams["timeslice_build_info"].samples
        assert info and info[0].labels["version"] and info[0].labels["component"] in ("lockd", "nodeagent"), who
        assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams, who
    lockd = families(scrape(endpoints(cluster)["lockd-r0"]))
    les = {float(s.labels["le"]) for s in lockd["timeslice_acquire_wait_seconds"].samples if "le" in s.labels}
    assert max(les - {float("inf")}) >= 600, "acquires wait up to 600 s; the buckets must reach that"


def test_grpc_server_metrics_count_calls_by_method_and_code(cluster):
    handled = {}
    for r in cluster.lockd:
        for s in families(scrape(r.info["metrics_port"]))["grpc_server_handled"].samples:
            key = (s.labels["grpc_method"], s.labels["grpc_code"])
            handled[key] = handled.get(key, 0) + s.value
    assert handled.get(("Acquire", "OK"), 0) >= 1 and handled.get(("CreateGroup", "OK"), 0) >= 20
    agent = families(scrape(cluster.agent.info["metrics_port"]))
    assert "grpc_server_handling_seconds" in agent


def test_agent_exports_the_duty_cycle_of_its_simulated_gpu(cluster):
    port = cluster.agent.info["metrics_port"]
    samples = []
    for _ in range(200):               # the first scrape starts the sampling; wait for a sample
        samples = families(scrape(port))["timeslice_agent_gpu_utilization_ratio"].samples
        if samples:
            break
        time.sleep(0.05)
    assert samples and samples[0].labels["gpu"] == "sim0" and 0.0 <= samples[0].value <= 1.0


def test_deleted_groups_leave_no_queue_depth_series(cluster):
    for r in cluster.lockd:
        fams = families(scrape(r.info["metrics_port"]))
        groups = {s.labels["group"] for s in fams["timeslice_queue_depth"].samples}
        assert not [g for g in groups if g.startswith("gone-")], f"lockd {r.name}: {sorted(groups)[:5]}"


def _listening_addresses(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:      # 0A = LISTEN
                out.add(addr)
    return out


def test_metrics_listen_on_loopback_only_in_local_mode(cluster):
    for who, port in endpoints(cluster).items():
        addrs = _listening_addresses(port)
        assert addrs == {"0100007F"}, f"{who} metrics on {addrs} (want 127.0.0.1 only)"


def _log_lines(path: str) -> list[str]:
    return [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]


def test_every_log_line_is_json_with_its_identity(cluster):
    for child, key in [(r, "replica") for r in cluster.lockd] + [(cluster.agent, "node")]:
        lines = _log_lines(child.log_path)
        assert lines, child.log_path
        bad = [ln for ln in lines if not ln.startswith("{")]
        assert bad == [], f"{child.log_path}: not JSON: {bad[:3]}"
        docs = [json.loads(ln) for ln in lines]
        assert [d for d in docs if d.get("ready")], f"{child.log_path}: no JSON ready line"
        missing = [d.get("event") for d in docs if not d.get(key)]
        assert missing == [], f"{child.log_path}: events without {key}: {missing[:5]}"
        reprs = [ln for ln in lines if "b'" in ln or 'b\\"' in ln]
        assert reprs == [], f"{child.log_path}: Python bytes reprs: {reprs[:2]}"
