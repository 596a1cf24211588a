"""benchmarks/gpu_jax_pair.py and gpu_jax_probe.py, dry runs on the CPU (JAX's CPU backend, the SIMULATED
device, real etcd): two JAX jobs time-sliced by checkpoint, and a cooperative JAX job beside a TRL GRPO
job in one group, each bit-identical to its standalone run of the same benchmark, every exit code 0,
the device really changing hands; and the probe's every way out and back intact. Also keeps the GPU
scripts from rotting: the same orchestration and analysis run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="needs the test extra (jax[cpu])")
pytest.importorskip("trl", reason="needs the test extra (torch, trl)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(600)   # seven job runs and two stacks (~45 CPU s): started first, beside the rest
def test_jax_pairs_by_checkpoint_and_beside_trl_equal_standalone_bit_for_bit(tmp_path):
    # (jax-cooperative, two cooperative JAX jobs, is the GPU run's; CI has that pair in
    # tests/integrations/test_jax_jobs.py, and the cooperative JAX job beside TRL here.)
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_jax_pair", "--dry-run", "--out", str(tmp_path),
                        "--regimes", "jax-checkpoint,mixed"], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_jax_pair_dryrun.json").read_text())
    assert doc["ok"] and doc["simulated"]
    assert set(doc["regimes"]) == {"jax-checkpoint", "mixed"}
    assert set(doc["standalone_exit_codes"].values()) == {0}
    for name, reg in doc["regimes"].items():
        assert "error" not in reg, (name, reg.get("error"))
        assert reg["exit_codes"] == [0, 0], name
        assert not reg["fit"]["fits_side_by_side"]
        for job, d in reg["degradation"].items():
            assert d["losses_identical"] and d["weights_identical"], (name, job, d)
        assert all(n >= 1 for n in reg["swaps_per_job"].values()), (name, reg["swaps_per_job"])   # both came back
    assert doc["regimes"]["jax-checkpoint"]["swap"]["swaps"] >= 3
    mixed = doc["regimes"]["mixed"]
    jax_job = mixed["jobs"][0]                                                  # job-a: JAX, cooperative
    assert mixed["backup"]["job-a"]["verified"] >= 1                            # every resume checked
    assert jax_job["residue_bytes_max"] == 256 << 10                            # the simulated context stays
    assert mixed["left_behind"]["job-a"] is not None                            # told at its first pause
    pin = mixed["first_pin"]["job-a"]                                           # reserved before it first asked
    assert pin["outside_any_hold"] and pin["host_bytes"] >= sum(jax_job["region_bytes"].values()) > 0
    assert set(mixed["first_pin"]) == {"job-a"}                                 # (TRL's pins in its first step)
    assert doc["round_trip"]["checkpoint_s"]
    assert "FAILED" not in (tmp_path / "gpu_jax_pair_dryrun.txt").read_text()


def test_the_probe_moves_the_state_every_way_intact(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_jax_probe", "--dry-run", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_jax_probe_dryrun.json").read_text())
    assert doc["ok"] and doc["backup"] == "host"
    m = doc["memory"]
    assert all(t["intact"] for t in m["dirty"] + m["clean"])
    assert m["stats"]["clean_skips"] == len(m["clean"]) and m["stats"]["copies_out"] == len(m["dirty"])
    assert doc["pinned_host"]["ok"] and doc["device_get"]["ok"] and doc["put_from_pool"]["intact"]
