"""benchmarks/gpu_timeslice.py, dry run on the SIMULATED device (no GPU): the 40 GiB pair of the issue
at GiB-as-MiB scale, once with the default room for a parked job's residue and once with none left for
it (--coop-residual-gb 1.5,0: both against one baseline). The grants admit the jobs' measured
footprints, so the parked job's residue leaves before each grant that needs its room: every job exits
0, no violation, ratios printed. Not a measurement."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_40g_pair_completes_at_the_default_room_and_with_none_left_for_the_residue(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_timeslice", "--dry-run", "--profile", "40g_long",
                        "--clean-weights", "--coop-residual-gb", "1.5,0", "--iters", "2", "--gen-s", "0.6",
                        "--reward-s", "1.0", "--train-s", "0.6", "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_timeslice_40g_long.json").read_text())
    base, *sliced = doc["results"]
    assert [x["label"] for x in sliced] == ["time-sliced, nofit-coop, residual 1.5 GB",
                                            "time-sliced, nofit-coop, residual 0 GB"], sliced
    assert [x["coop_residual_gb"] for x in sliced] == [1.5, 0.0]
    assert base["job_exit_codes"] == [0, 0] and base["violations"] == [], base
    for run in sliced:
        assert run["job_exit_codes"] == [0, 0] and run["violations"] == [], run
        assert run["swaps_restored"] >= 2
        mem = run["memory"]
        for job in ("job-a", "job-b"):
            assert mem[job]["measured"]["peak"] > 40 << 20 and mem[job]["measured"]["context"] > 0, mem
            assert mem[job]["residues"] and all(n > 0 for n in mem[job]["residues"]), mem
    assert sliced[1]["memory"]["agent"]["residue_checkpoints"] >= 1, sliced[1]["memory"]   # none left: it went
    assert [c["label"] for c in doc["comparison"]] == [x["label"] for x in sliced]
    assert all("wall_vs_one_after_the_other" in c for c in doc["comparison"]) and "FAILED" not in r.stdout
