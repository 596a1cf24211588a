"""benchmarks/gpu_timeslice.py, dry run on the SIMULATED device (no GPU): the 40 GiB pair of the issue
at GiB-as-MiB scale, with no room left for a parked job's residue (--coop-residual-gb 0). The grants
admit the jobs' measured footprints, so the parked job's residue leaves before each grant that needs
its room: every job exits 0, no violation, ratios printed. Not a measurement."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_40g_pair_completes_with_no_room_left_for_the_residue(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_timeslice", "--dry-run", "--profile", "40g_long",
                        "--clean-weights", "--coop-residual-gb", "0", "--iters", "2", "--gen-s", "0.6",
                        "--reward-s", "1.0", "--train-s", "0.6", "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_timeslice_40g_long.json").read_text())
    base, sliced = doc["results"]
    assert base["job_exit_codes"] == [0, 0] == sliced["job_exit_codes"], (base, sliced)
    assert base["violations"] == [] == sliced["violations"]
    assert sliced["swaps_restored"] >= 2
    mem = sliced["memory"]
    for job in ("job-a", "job-b"):
        assert mem[job]["measured"]["peak"] > 40 << 20 and mem[job]["measured"]["context"] > 0, mem
        assert mem[job]["residues"] and all(n > 0 for n in mem[job]["residues"]), mem
    assert mem["agent"]["residue_checkpoints"] >= 1, mem            # the residue went, by the planner's word
    [row] = doc["comparison"]
    assert "wall_vs_one_after_the_other" in row and "FAILED" not in r.stdout
