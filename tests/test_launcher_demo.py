"""The local cluster launcher (`timeslice up`) and the demo (`timeslice demo`), as real processes.

A detached cluster is started once for the module (etcd, 3 lockd replicas, a
node agent); the tests check its state file and that every endpoint answers,
run a short demo against it, and finally stop it and check that nothing is
left. A second test drives the foreground launcher with a 3-member etcd and
stops it with SIGINT, as Ctrl-C would. No assertion is made on durations.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from timeslice.launcher import settings as L
from timeslice.launcher.procs import log_events, same_process
from timeslice.launcher.state import find_running
from timeslice.lockd.report.figures import (
    gpu_phases,
    overlapping_pairs,
    read_events,
    union_length,
)
from timeslice.testing.ctl import etcdctl_run, http_json

PY = sys.executable


def timeslice(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TIMESLICE_TARGET", None)
    return subprocess.run([PY, "-m", "timeslice.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def alive(p: dict) -> bool:
    return same_process(int(p["pid"]), p.get("start_time"))


def kill_leftovers(doc: dict) -> None:
    for p in doc.get("processes", []):
        if alive(p):
            try:
                os.killpg(int(p["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def grpc_serving(target: str, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


# -- settings (no processes) ---------------------------------------------------------------------

def test_settings_from_local_env_and_flags(tmp_path):
    s, origin = L.load()
    assert origin.endswith("deploy/local.env")
    assert (s.etcd_members, s.lockd_replicas, s.prefix, s.backend) == (1, 3, "/timeslice/", "auto")
    assert s.group_sharing == "fit"                     # the group `timeslice up` creates (deploy/local.env says why)
    env = tmp_path / "x.env"
    env.write_text("# comment\nETCD_MEMBERS=3\nLOCKD_REPLICAS=5\n")
    s, origin = L.load(env, {"LOCKD_REPLICAS": 2, "BACKEND": "sim", "PREFIX": None})
    assert (s.etcd_members, s.lockd_replicas, s.backend, s.prefix) == (3, 2, "sim", "/timeslice/")
    for bad in ({"ETCD_MEMBERS": 2}, {"LOCKD_PORT": 70000}, {"PREFIX": "nope"}, {"BACKEND": "gpu"},
                {"SIM_DEVICES": 2}, {"LOCKD_REPLICAS": "x"}, {"GROUP_SHARING": "shared"}):
        with pytest.raises(L.SettingsError):
            L.load(env, bad)
    env.write_text("NOT_A_KEY=1\n")
    with pytest.raises(L.SettingsError, match="unknown key"):
        L.load(env)
    assert L.flag_name("SIM_DEVICE_CAPACITY_BYTES") == "--sim-device-capacity-bytes"


def test_up_flags_cover_every_key():
    from timeslice.cli import build_parser
    a = build_parser().parse_args(["up", "--replicas", "5", "--etcd-members", "3", "--backend", "sim"])
    assert (a.cfg_LOCKD_REPLICAS, a.cfg_ETCD_MEMBERS, a.cfg_BACKEND) == (5, 3, "sim")
    for key in L.Settings.key_names():
        assert hasattr(a, f"cfg_{key}")


def test_launcher_modules_import_no_cycle():
    """One concept per module and no module that needs its own importer (state.py once imported
    cluster.py, which imports state.py): function-level imports count too, type-only ones do not."""
    import ast
    folder = Path(L.__file__).parent
    names = {p.stem for p in folder.glob("*.py")} - {"__init__"}

    def imports(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                continue
            if isinstance(child, ast.ImportFrom):
                yield child.module or "", [a.name for a in child.names]
            elif isinstance(child, ast.Import):
                yield from ((a.name, []) for a in child.names)
            yield from imports(child)

    deps: dict[str, set[str]] = {}
    for name in names:
        found = set()
        for mod, what in imports(ast.parse((folder / f"{name}.py").read_text())):
            if mod.startswith("timeslice.launcher."):
                found.add(mod.split(".")[2])
            elif mod == "timeslice.launcher":
                found |= set(what) & names
        deps[name] = found - {name}
    assert deps["state"] and deps["cluster"], "the walk found no imports: it is broken"

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in deps.get(a, ()))

    cycles = sorted(n for n in names if reaches(n, n, {n}))
    assert cycles == [], f"launcher modules in an import cycle: {cycles} ({ {n: deps[n] for n in cycles} })"


def test_analysis_helpers():
    ph = [{"job": "a", "t_start": 0.0, "t_end": 1.0, "gpu": True, "type": "phase"},
          {"job": "b", "t_start": 1.0, "t_end": 2.0, "gpu": True, "type": "phase"},
          {"job": "b", "t_start": 2.5, "t_end": 3.0, "gpu": True, "type": "phase"},
          {"job": "a", "t_start": 2.9, "t_end": 3.5, "gpu": True, "type": "phase"}]
    bad = overlapping_pairs(ph)
    assert [(x["job"], y["job"]) for x, y in bad] == [("b", "a")]
    assert union_length([(0, 1), (1, 2), (2.5, 3), (2.9, 3.5)]) == pytest.approx(3.0)


# -- a detached cluster -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("runs")
    run = logs / "run1"
    r = timeslice("up", "--detach", "--logdir", str(run), "--log-dir", str(logs), timeout=120)
    doc = json.loads((run / "cluster.json").read_text()) if (run / "cluster.json").exists() else {}
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield {"logs": logs, "run": run, "doc": doc, "stdout": r.stdout}
    finally:
        if doc and any(alive(p) for p in doc["processes"]):
            timeslice("up", "--stop", "--logdir", str(run), timeout=90)
            kill_leftovers(doc)


def test_up_starts_everything_and_writes_the_state_file(cluster):
    doc, run, out = cluster["doc"], cluster["run"], cluster["stdout"]
    assert doc["status"] == "running" and doc["run_dir"] == str(run)
    kinds = [p["kind"] for p in doc["processes"]]
    assert kinds.count("etcd") == 1 and kinds.count("lockd") == 3 and kinds.count("nodeagent") == 1
    for p in doc["processes"]:
        assert alive(p), p
        assert Path(p["log"]).parent == run, "every log lives in the run's folder"
        assert Path(p["log"]).exists()
    assert (run / "etcd").is_dir() and (run / "nodeagent-state").is_dir()
    # What the user is told to export / run is what the state file says.
    assert f"export TIMESLICE_TARGET={doc['target']}" in out
    assert doc["target"] == ",".join(doc["lockd_targets"]) and len(doc["lockd_targets"]) == 3
    assert f"etcdctl --endpoints {','.join(doc['etcd_endpoints'])} get --prefix /timeslice/" in out
    assert doc["backend"] in ("sim", "cuda-driver", "cuda-cli")
    assert f"backend {doc['backend']}" in out
    if doc["backend"] == "sim":
        assert Path(doc["sim"]["dir"]).is_dir()
    assert find_running(cluster["logs"])[0] == run / "cluster.json"


def test_up_endpoints_answer(cluster):
    doc = cluster["doc"]
    for ep in doc["etcd_endpoints"]:
        assert (http_json(int(ep.rsplit(":", 1)[1]), "/health", None, 2.0) or {}).get("health") in ("true", True)
    for t in doc["lockd_targets"]:
        assert grpc_serving(t), f"lockd {t} not SERVING"
    agent = next(p for p in doc["processes"] if p["kind"] == "nodeagent")
    assert grpc_serving(f"127.0.0.1:{agent['port']}"), "nodeagent not SERVING"
    keys = etcdctl_run(doc["etcd_endpoints"], ["get", "--prefix", "/timeslice/", "--keys-only"], 10).split()
    assert f"/timeslice/nodes/{doc['node']}/agent" in keys
    assert "/timeslice/groups/local/spec" in keys
    assert sum(k.startswith("/timeslice/leader/") for k in keys) == 3
    from timeslice import OrchestratorClient
    with OrchestratorClient(doc["target"], job_id="test-launcher") as c:
        assert {g.group_id: g.sharing for g in c.groups()}.get("local") == "fit"


ROW = re.compile(r"^\s+(baseline|sliced-swap|sliced-coop|sliced-elide)\s+([\d.]+) s\s+([\d.]+) s\s+([\d.]+)%\s+(\S+)\s+(\S+)"
                 r"\s+(\S+)\s+(-|[\d.]+ MB)\s+(\d+)\s*$", re.MULTILINE)


@pytest.mark.slow
def test_demo_short_run_on_the_running_cluster(cluster, tmp_path):
    out = tmp_path / "demo"
    r = timeslice("demo", "--iterations", "2", "--out", str(out), "--log-dir", str(cluster["logs"]),
                  "--generate-s", "0.5", "--rewards-s", "0.75", "--train-s", "0.25", timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "using the running local cluster" in r.stdout
    # The picture: a PNG, at the path printed last.
    m = re.search(r"^timeline: (.+)$", r.stdout, re.MULTILINE)
    assert m, text
    png = Path(m.group(1))
    assert png == out / "timeline.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The printed figures parse.
    rows = {g[0]: g for g in ROW.findall(r.stdout)}
    assert set(rows) == {"baseline", "sliced-swap", "sliced-coop", "sliced-elide"}, r.stdout
    for key, (_, wall, busy, duty, swaps, elided, restores, moved, overlaps) in rows.items():
        assert float(wall) > 0 and float(busy) > 0 and 0 < float(duty) <= 100
        assert overlaps == "0"
    swap, elide = rows["sliced-swap"], rows["sliced-elide"]
    assert int(swap[4]) > 0 and int(swap[6]) > 0 and float(swap[7].split()[0]) > 0, "real swaps happened"
    assert int(elide[5]) > 0, "the small jobs' swaps were elided"
    coop = rows["sliced-coop"]
    assert int(coop[4]) > 0 and int(coop[6]) > 0, "cooperative swaps happened (the jobs moved their own memory)"
    summary = json.loads((out / "summary.json").read_text())
    assert [r_["key"] for r_ in summary["runs"]] == ["baseline", "sliced-swap", "sliced-coop", "sliced-elide"]

    # From the jobs' own records: the time-sliced critical sections never overlap,
    # tokens grow in grant order, and every restored context verified.
    for key in ("sliced-swap", "sliced-elide"):
        evs = [e for f in sorted((out / "events" / key).glob("job-*.jsonl")) for e in read_events(f)]
        gpu = gpu_phases(evs)
        assert len({e["job"] for e in gpu}) == 2 and len(gpu) == 2 * 2 * 2
        assert all("token" in e for e in gpu), "every GPU phase ran under a grant"
        assert overlapping_pairs(gpu) == []
        ordered = sorted(gpu, key=lambda e: e["t_start"])
        for a, b in pairwise(ordered):
            assert a["t_end"] <= b["t_start"], (a, b)
            assert a["token"] < b["token"], (a, b)
        restored = [e for e in gpu if e.get("restored")]
        assert all(e["verified"] is True for e in restored)
        if key == "sliced-swap":
            assert restored and sum(e["bytes_moved"] for e in gpu) > 0
        ends = [e for e in evs if e["type"] == "end"]
        assert len(ends) == 2 and all(e["bad_verifies"] == 0 for e in ends)
    base = [e for f in (out / "events" / "baseline").glob("job-*.jsonl") for e in read_events(f)]
    assert all("token" not in e for e in gpu_phases(base)), "the baseline does not use the lock"


def test_up_writes_a_private_admin_token_that_the_cli_finds(cluster, tmp_path):
    doc = cluster["doc"]
    token_file = Path(doc["admin_token_file"])
    assert token_file.parent == cluster["run"] and token_file.stat().st_mode & 0o777 == 0o600
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIMESLICE_ADMIN_TOKEN", "TIMESLICE_TARGET"))}
    here = tmp_path / "here.env"
    here.write_text(f"LOG_DIR={cluster['logs']}\n")        # where `timeslice up` keeps its runs
    r = subprocess.run([PY, "-m", "timeslice.cli", "group", "create", "tok-g", "--node", doc["node"]],
                       capture_output=True, text=True, timeout=60, check=False, env={**env, "TIMESLICE_LOCAL_ENV": str(here)})
    assert r.returncode == 0, r.stdout + r.stderr
    elsewhere = tmp_path / "elsewhere.env"
    elsewhere.write_text(f"LOG_DIR={tmp_path / 'no-runs'}\n")   # no local cluster: no token to find
    # ... and no per-user pointer to it either (the CLI finds a running cluster from anywhere through it)
    r = subprocess.run([PY, "-m", "timeslice.cli", "--target", doc["target"], "group", "delete", "tok-g"],
                       capture_output=True, text=True, timeout=60, check=False,
                       env={**env, "TIMESLICE_LOCAL_ENV": str(elsewhere),
                            "TIMESLICE_USER_STATE_DIR": str(tmp_path / "no-state")})
    assert r.returncode == 1 and "admin" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([PY, "-m", "timeslice.cli", "group", "delete", "tok-g"],
                       capture_output=True, text=True, timeout=60, check=False, env={**env, "TIMESLICE_LOCAL_ENV": str(here)})
    assert r.returncode == 0, r.stdout + r.stderr


TEN_LINES_JOB = """
import json, os, sys
from timeslice import OrchestratorClient
from timeslice.cooperative import CallbackMemory
orchestrator = OrchestratorClient(job_id=sys.argv[1])      # the target: $TIMESLICE_TARGET
w = orchestrator.register_worker()                          # this process owns GPU memory on this node
with orchestrator.on_accelerators("local"):
    coop = orchestrator.cooperate(CallbackMemory(lambda: None, lambda: None, 1 << 20, device="sim0"))
print(json.dumps({"pid": os.getpid(), "worker_pid": w.pid, "coop_pid": coop.pid}), flush=True)
orchestrator.close()
"""


@pytest.mark.parametrize("with_socket", [True, False], ids=["exports", "exports-without-the-socket"])
def test_a_job_started_with_what_up_prints_attests_to_its_agent(cluster, with_socket):
    """The exports `timeslice up` printed, then the README's API: the worker attests over the agent's
    channel (the agent requires it here), whether the socket is exported or found through the pointer."""
    exports = dict(re.findall(r"^\s*export (TIMESLICE_\w+)=(\S+)", cluster["stdout"], re.MULTILINE))
    assert {"TIMESLICE_TARGET", "TIMESLICE_NODE_NAME", "TIMESLICE_AGENT_SOCKET"} <= set(exports), cluster["stdout"]
    assert exports["TIMESLICE_AGENT_SOCKET"] == cluster["doc"]["agent_socket"]
    if not with_socket:
        del exports["TIMESLICE_AGENT_SOCKET"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_") or k == "TIMESLICE_USER_STATE_DIR"}
    job = f"ten-lines-{'sock' if with_socket else 'ptr'}"
    r = subprocess.run([PY, "-c", TEN_LINES_JOB, job], capture_output=True, text=True, timeout=60, check=False,
                       env={**env, **exports})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worker_not_attested" not in r.stdout + r.stderr, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["worker_pid"] == got["coop_pid"] == got["pid"]
    agent_log = cluster["run"] / "nodeagent.log"
    connected = [e for e in log_events(str(agent_log)) if e.get("event") == "channel_worker_connected"
                 and e.get("job") == job]
    # Twice from the job's process: the attestation of register_worker(), then the cooperative channel.
    assert [e["pid"] for e in connected] == [got["pid"], got["pid"]], connected
    assert "--require-attestation" in next(p for p in cluster["doc"]["processes"] if p["kind"] == "nodeagent")["argv"]


def _listen_addresses(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (IPv4, from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, p = local.partition(":")
        if state == "0A" and int(p, 16) == port:
            out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_up_serves_metrics_on_loopback_only(cluster):
    ports = [p["metrics_port"] for p in cluster["doc"]["processes"] if p.get("metrics_port")]
    assert ports
    for port in ports:
        assert _listen_addresses(int(port)) == {"127.0.0.1"}, port


def test_up_stop_leaves_no_process(cluster):
    doc, run = cluster["doc"], cluster["run"]
    sim_dir = (doc.get("sim") or {}).get("dir")
    r = timeslice("up", "--stop", "--logdir", str(run), timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["name"] for p in doc["processes"] if alive(p)] == []
    after = json.loads((run / "cluster.json").read_text())
    assert after["status"] == "stopped"
    assert find_running(cluster["logs"]) is None
    if sim_dir:
        assert not Path(sim_dir).exists(), "the simulated device goes with the cluster"
    assert any(run.glob("lockd-r*.log")) and (run / "nodeagent.log").exists(), "logs stay"


# -- the foreground launcher and Ctrl-C --------------------------------------------------------------

def test_up_foreground_three_etcd_members_and_sigint(tmp_path):
    run = tmp_path / "fg"
    proc = subprocess.Popen([PY, "-m", "timeslice.cli", "up", "--logdir", str(run), "--etcd-members", "3",
                             "--group", ""], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops" in line:
                ready.set()
    threading.Thread(target=pump, daemon=True).start()
    doc = {}
    try:
        assert ready.wait(120), "".join(lines)
        doc = json.loads((run / "cluster.json").read_text())
        assert [p["kind"] for p in doc["processes"]].count("etcd") == 3
        assert len(doc["etcd_endpoints"]) == 3
        assert all(alive(p) for p in doc["processes"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, "".join(lines)
        text = "".join(lines)
        assert [p["name"] for p in doc["processes"] if alive(p)] == []
        assert json.loads((run / "cluster.json").read_text())["status"] == "stopped"
        # Shutdown order: the agent, then the lockd replicas, then etcd.
        i_agent, i_lockd, i_etcd = (text.index("nodeagent " + doc["node"] + ": stopping"),
                                    text.index("lockd: stopping"), text.index("etcd: stopping"))
        assert i_agent < i_lockd < i_etcd
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(doc)

