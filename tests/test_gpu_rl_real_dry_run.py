"""benchmarks/gpu_rl_real.py, dry run: two TRL GRPO jobs (tiny random-init Qwen2, CPU reward with a
sleep-like CPU burn) run alone one after the other, then time-sliced through lockd and the node agent
on the SIMULATED device (real etcd) in every regime the GPU run has: cooperative, checkpoint and
strict. Their model and optimizer state live in SimTorchMemory, a SIMULATOR whose pause copies them
out and overwrites them with NaN, so a phase run outside its hold would show. Each sliced job's
per-step losses and final weights equal its standalone run's, bit for bit; and the device really
changed hands. Also keeps the GPU script from rotting: the same orchestration and analysis run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="needs the test extra (torch, trl)")


def test_trl_grpo_pair_time_sliced_in_every_regime_equals_standalone_bit_for_bit(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The jobs declare a peak 20% below what they measured alone (--hint-factor 0.8): the lock's own
    # measures keep every grant usable (README, "Memory a grant admits").
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_rl_real", "--dry-run", "--hint-factor", "0.8",
                        "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_rl_real_dryrun.json").read_text())
    assert doc["ok"] and doc["simulated"]
    assert set(doc["regimes"]) == {"standalone", "cooperative", "checkpoint", "strict"}
    base = doc["regimes"]["standalone"]
    assert [j["steps"] for j in base["jobs"]] == [2, 2]
    for name in ("cooperative", "checkpoint", "strict"):
        reg = doc["regimes"][name]
        assert "error" not in reg, reg.get("error")
        assert not reg["fit"]["fits_side_by_side"]
        for job in ("job-a", "job-b"):
            d = reg["degradation"][job]
            assert d["losses_identical"] and d["weights_identical"], (name, d)
        assert reg["swap"]["swaps"] >= 1, name                   # the agent moved memory...
        assert any(j["restored"] for j in reg["jobs"]), name     # ...and brought a job back
        assert reg["jobs"][0]["tokens"] > 0 and reg["jobs"][0]["samples"] > 0
    coop = doc["regimes"]["cooperative"]["jobs"]
    assert all(j["residue_bytes_max"] == 256 << 10 for j in coop)   # the simulated context stays behind
    assert all(j["region_bytes"]["optimizer"] > 0 for j in coop)     # AdamW's lazy state was placed
    for name in ("cooperative", "checkpoint", "strict"):
        reg = doc["regimes"][name]
        for i, j in enumerate(reg["jobs"]):   # declared 20% short; the client measured its holds
            assert reg["hints_bytes"][i] == int(base["jobs"][i]["peak_bytes"] * 0.8), (name, reg["hints_bytes"])
            if name != "checkpoint":   # a checkpointed job's memory is the agent's meter's, not the client's
                assert j["measured"]["peak"] > reg["hints_bytes"][i] and j["measured"]["context"] > 0, (name, j)
    assert all(j["residue_bytes"] and j["residue_bytes"][0] == 256 << 10 for j in coop)
    text = (tmp_path / "gpu_rl_real_dryrun.txt").read_text()
    assert "cooperative" in text and "cooperative: job-a declared" in text, text
