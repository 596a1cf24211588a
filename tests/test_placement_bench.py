"""benchmarks/placement.py --quick: one mix of 4 jobs on the SIMULATED device, grouped in arrival
order and as `advise` proposes, each run measured (real etcd, lockd, node agent, job processes)."""
from __future__ import annotations

import math

import pytest

from benchmarks import placement


@pytest.mark.slow
def test_quick_mode_runs_both_groupings_and_predicts_each(tmp_path):
    a = placement.parser().parse_args(["--quick", "--out", "", "--log-dir", str(tmp_path)])
    results, summary = placement.run(a)
    assert summary["mixes"] == 1 and summary["predictions"] == 2
    r = results[0]
    names = sorted(j["name"] for j in r["mix"])
    for key in ("baseline", "advised"):
        grouped = sorted(j for g in r[key]["groups"] for j in g["jobs"])
        assert grouped == names                       # every job in exactly one group
        assert 0 < r[key]["predicted"] <= 1 and 0 < r[key]["measured"] <= 1
        for g in r[key]["groups"]:
            assert all(n >= 1 for n in g["holds"].values()), g   # every job held its GPUs in the window
            assert 0 < g["predicted"] <= 1
    assert r["gpus"]["advised"] <= r["gpus"]["baseline"]         # never more GPU sets than today
    assert all(math.isfinite(s["measured"]) for s in r["slowdown"].values())
