"""benchmarks/gpu_multi.py, dry run on the SIMULATED device (no GPU): the launcher/rank
plumbing, per-GPU swap times from the agent's per-process log, the all-reduce check after
every restore and the collective refusal, so the GPU run cannot fail on a plumbing bug."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_gpu_multi_dry_run_on_simulated_gpus(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_multi", "--sim", "--no-standalone", "--iters", "1",
                        "--gen-s", "0.2", "--reward-s", "0.3", "--train-s", "0.2", "--mem-gb", "4",
                        "--regimes", "nofit,collective-refused", "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_multi.json").read_text())
    nofit, refused = doc["results"]
    assert nofit["violations"] == [] and nofit["restored_phases"] >= 1
    assert nofit["allreduce_checked_after_restore"] == nofit["restored_phases"]
    assert set(nofit["per_gpu_s"]) == {"gpu0", "gpu1"} and nofit["refused_restores"] == 0
    assert refused["violations"] == [] and refused["refused_snapshots"] >= 1 and refused["restored_phases"] == 0
    assert "gpu0" in (tmp_path / "gpu_multi.txt").read_text()
