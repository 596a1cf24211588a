"""Four TRL GRPO jobs through one group on the SIMULATED device, one at a time (the device holds one
job's regions beside every job's context, so every handoff moves memory): real etcd, one lockd
replica, the node's agent, four job processes (examples/grpo/trl_job.py: tiny models, 2 steps).

* every job's per-step losses and final weights equal, bit for bit, those of the same job run alone;
* FIFO with three waiters: no grant went past a job that had waited longer (the jobs' own hold
  records, benchmarks/rl_real_timeline.py), every job waited for the others, all four took turns;
* each job's pinned host backup was admitted by the node agent before it was made (its host
  admission), while the jobs were already registered: before their first hold, in the background.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the real-framework tests need the test extra (torch, trl)")
pytest.importorskip("trl", reason="the real-framework tests need the test extra (torch, trl)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "grpo"))
import realmodel as R  # noqa: E402

from benchmarks import rl_real_timeline as T  # noqa: E402

CONTEXT = 256 << 10          # SimTorchMemory's default context: what a parked job keeps on the device
JOBS = ("four-a", "four-b", "four-c", "four-d")


def args(seed: int) -> list[str]:
    return ["--seed", str(seed), "--steps", "2", "--reward-s", "0.3"]


@pytest.mark.timeout(900)             # eight TRL processes on a CI machine's cores
def test_four_trl_jobs_one_at_a_time_equal_their_standalone_runs_in_fifo_order(rl_stack, alone):
    base = alone([("trl_job.py", f"alone-{j[-1]}", args(i + 1), True) for i, j in enumerate(JOBS)])
    sizes = sorted(R.device_bytes(d) for d in base)
    jobs, agent = rl_stack(len(JOBS) * CONTEXT + sizes[-1] + sizes[0] // 2)   # one job's regions, never two
    docs = jobs.run([("trl_job.py", j, args(i + 1), False) for i, j in enumerate(JOBS)], timeout=600)
    for a, s in zip(base, docs):
        assert s["steps"] == a["steps"] == 2
        assert s["losses"] == a["losses"], (s["job"], s["losses"], a["losses"])     # exact floats
        assert s["digest"] == a["digest"], s["job"]
        assert s["swaps"] >= 2 and any(h["restored"] for h in s["events"] if h["ev"] == "hold"), s["job"]
    assert len({d["digest"] for d in base}) == len(JOBS)                             # four different jobs
    order = T.order(docs)
    assert order["fifo_inversions"] == 0, order["inversions"]
    assert set(order["order"]) == {"a", "b", "c", "d"} and len(order["order"]) >= 4 * 3
    waits = T.waits(docs)
    assert all(w["max_s"] > 0 for w in waits.values()), waits                        # each waited its turn
    admitted = {e.get("job") for e in agent.events("host_backup_admitted")}
    assert set(JOBS) <= admitted, admitted
    for d in docs:
        reg = [e for e in d["events"] if e["ev"] == "registered"]
        assert reg and reg[0]["held"] is False, reg                                  # before the first hold
