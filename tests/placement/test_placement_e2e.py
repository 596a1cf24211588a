"""`timeslice profile` and `timeslice advise` against a live local cluster (the launcher's etcd, lockd
and SIMULATED-device agent) after a few short jobs ran in two groups."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from timeslice import OrchestratorClient
from timeslice.cli import main as cli
from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.settings import Settings

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
JOBS = {"pa": ("g", 80, 300, 16), "pb": ("g", 80, 300, 16), "pc": ("g2", 150, 200, 24)}   # group, hold, gap, MiB


@pytest.fixture
def cluster(tmp_path):
    s = Settings(etcd_members=1, lockd_replicas=1, backend="sim", sim_device_capacity_bytes=64 * MiB,
                 sim_snapshot_bytes_per_s=0, sim_restore_bytes_per_s=0)
    c = LocalCluster(s, tmp_path / "run", node="n1", group="g", progress=lambda _m: None,
                     sim_dir=str(tmp_path / "sim")).start()
    yield c
    c.stop(quiet=True)


def run_cli(capsys, *argv: str) -> str:
    capsys.readouterr()
    rc = cli(list(argv))
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


def busy_series(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("timeslice_job_busy_ratio{"):
            job = line.split('job="')[1].split('"')[0]
            out[job] = float(line.rsplit(" ", 1)[1])
    return out


def test_profile_and_advise_on_a_live_cluster(cluster, tmp_path, capsys):
    t = ["--target", cluster.target]
    with OrchestratorClient(cluster.target, job_id="e2e-admin", timeout=30) as admin:
        admin.create_group("g2", ["n1"])
        until = time.time() + 6
        procs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.placement_job", "--target", cluster.target, "--job-id", j,
             "--group", g, "--node", "n1", "--sim-dir", cluster.sim_dir, "--bytes", str(mib * MiB),
             "--hold-ms", str(hold), "--gap-ms", str(gap), "--jitter", "0.1", "--until", str(until),
             "--events", str(tmp_path / f"{j}.jsonl")], cwd=ROOT, env=dict(os.environ),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for j, (g, hold, gap, mib) in JOBS.items()]
        try:
            # While they run, the leader exports each live job's busy share.
            port = cluster.lockd[0].info["metrics_port"]
            deadline = time.monotonic() + 30
            while set(busy_series(port)) < set(JOBS):
                assert time.monotonic() < deadline, busy_series(port)
                time.sleep(0.2)
            assert all(0 < v < 1 for v in busy_series(port).values())
        finally:
            for p in procs:
                _, err = p.communicate(timeout=180)   # a loaded 2-core machine: imports and FIFO turns take long
                assert p.returncode == 0, err[-2000:]

        deadline = time.monotonic() + 20             # the leader writes its history of holds every second
        while True:
            doc = json.loads(run_cli(capsys, "profile", "--json", *t))
            got = {p["job"]: p for p in doc["profiles"]}
            if set(got) >= set(JOBS) and all(len(got[j]["hold_ms"]) >= 3 and got[j]["busy_ms"] for j in JOBS):
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.3)
        for j, (g, hold, gap, mib) in JOBS.items():
            p = got[j]
            assert p["group"] == g and p["gap_ms"] and p["wait_ms"]
            assert min(p["hold_ms"]) >= hold * 0.9 * 0.95          # the job's (jittered) GPU phases
            assert max(p["busy_ms"]) <= max(p["hold_ms"])           # its own measure sits inside the lock's
            assert p["device_bytes"] >= mib * MiB and p["gpu_bytes"]
        assert {g["group"] for g in doc["groups"]} >= {"g", "g2"} and doc["nodes"][0]["gpus"]
        table = run_cli(capsys, "profile", "pa", *t)
        assert "pa" in table and "HOLD ms" in table and "pb" not in table

        file = tmp_path / "profiles.json"
        file.write_text(json.dumps(doc))
        adv = json.loads(run_cli(capsys, "advise", "--from", str(file), "--json"))
        assert sorted(j for g in adv["proposal"]["groups"] for j in g["jobs"]) == sorted(JOBS)
        assert sorted(tuple(g["jobs"]) for g in adv["today"]["groups"]) == [("pa", "pb"), ("pc",)]
        assert 0 < adv["proposal"]["duty"] <= 1 and 0 < adv["today"]["duty"] <= 1
        assert "proposal:" in run_cli(capsys, "advise", "--from", str(file))

        applied = json.loads(run_cli(capsys, "advise", "--apply", "--json", "--name-prefix", "adv-", *t))
        made = applied["created"]
        assert made and all(n.startswith("adv-") for n in made)
        groups = {g.group_id: g for g in admin.groups()}
        assert all(n in groups and [x.node for x in groups[n].nodes] == ["n1"] for n in made)


def test_advise_from_a_bad_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "profiles": [{"job": "a"}]}')
    assert cli(["advise", "--from", str(bad)]) == 1
    assert "each profile needs a job and a group" in capsys.readouterr().err
