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
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_rl_real", "--dry-run", "--out", str(tmp_path)],
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
    assert "cooperative" in (tmp_path / "gpu_rl_real_dryrun.txt").read_text()


@pytest.mark.timeout(1800)
def test_four_trl_jobs_of_which_two_fit_share_exactly_where_their_footprints_fit(tmp_path):
    """--jobs 4 --mix half on the SIMULATED device (room for two of the four declared footprints):
    through a fit group the holds overlap, never more than two at once and never over the device's
    capacity, nobody beside an exclusive hold; every job's losses and weights equal its standalone
    run's, bit for bit; every exit code 0; the jobs together with no lock are skipped (they would not
    fit), and marked so."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_rl_real", "--dry-run", "--jobs", "4", "--mix", "half",
                        "--regimes", "nolock,fit", "--job-timeout", "600", "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_rl_real_half4_dryrun.json").read_text())
    assert doc["ok"] and doc["simulated"]
    assert set(doc["regimes"]) == {"standalone", "half/nolock", "half/fit"}
    assert "skipped" in doc["regimes"]["half/nolock"]
    fit = doc["regimes"]["half/fit"]
    assert "error" not in fit, fit.get("error")
    assert fit["fit"]["fit_at_once"] == 2 and fit["exit_codes"] == [0, 0, 0, 0]
    sh = fit["sharing"]
    assert sh["max_holders"] == 2, sh                    # side by side exactly as far as the footprints fit
    assert sh["holds_beside_another"] >= 1 and sh["over_capacity"] == 0 and sh["exclusive_beside_another"] == 0
    for job in ("job-a", "job-b", "job-c", "job-d"):
        d = fit["degradation"][job]
        assert d["losses_identical"] and d["weights_identical"], (job, d)
    assert [t["what"] for t in doc["targets"]] == ["wall_vs_standalone"]
    assert "half/fit" in (tmp_path / "gpu_rl_real_half4_dryrun.txt").read_text()
