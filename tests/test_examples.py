"""The runnable examples in examples/ run, on the simulated device, and do what they say."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str, env: dict | None = None, timeout: float = 300) -> dict:
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})}, check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def cluster(tmp_path):
    s = Settings(etcd_members=1, lockd_replicas=1, backend="sim", sim_device_capacity_bytes=64 << 20)
    c = LocalCluster(s, tmp_path / "run", node="ex-node", group=None, progress=lambda _m: None,
                     sim_dir=str(tmp_path / "sim")).start()
    yield c
    c.stop(quiet=True)


@pytest.mark.slow
def test_grpo_pair_time_slices_one_gpu(cluster):
    out = run(str(ROOT / "examples" / "grpo" / "run_pair.py"), "--target", cluster.target, "--node", cluster.node,
              "--sim-dir", cluster.sim_dir, "--iterations", "2", "--phase-s", "0.05")
    assert out["ok"] and len(out["jobs"]) == 2
    for job in out["jobs"]:
        assert job["digest_ok"] and job["iterations"] == 2
        # 40 MiB each on a 64 MiB device: they never fit together, so holds restore.
        assert job["restored"] >= 1 and job["elided"] == 0


def test_sampler_sleeps_so_the_trainer_fits():
    out = run(str(ROOT / "examples" / "app_endpoint" / "sampler_trainer.py"), "--rounds", "2")
    assert out["ok"] and out["simulated"] and out["trainer_fits_beside_awake_sampler"] is False
    assert all(r["weights_bit_exact"] and r["freed_bytes"] > 0 for r in out["rounds"])


def test_every_example_is_listed_in_its_readme():
    text = (ROOT / "examples" / "README.md").read_text()
    for p in (ROOT / "examples").rglob("*"):
        if p.suffix == ".py" or p.name == "kustomization.yaml":
            rel = str((p if p.suffix == ".py" else p.parent).relative_to(ROOT / "examples"))
            assert rel in text, f"examples/README.md does not mention {rel}"
