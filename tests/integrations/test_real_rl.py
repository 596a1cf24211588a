"""Real RL frameworks through timeslice, on the SIMULATED device: a plain transformers GRPO loop
and TRL's GRPOTrainer, jobs time-sliced through lockd and the node agent (real etcd). (The TRL
pair in every regime: tests/test_gpu_rl_real_dry_run.py, the GPU benchmark's dry run.)

Each job's model and optimizer state live in ``SimTorchMemory``, a SIMULATOR whose pause
copies them out and overwrites them with NaN, so a phase that ran outside its hold would
change what the job computes. The check is the strongest "no model degradation" there is:
each sliced job's per-step losses and final weights equal, bit for bit, those of the same
job run alone with the same seed; and the device really was handed over (the jobs were
paused and restored). A negative control shows the poisoning is seen: a job whose reward
function runs the model outside its hold computes with NaN and ends with other weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the real-framework tests need the test extra (torch, trl)")
pytest.importorskip("trl", reason="the real-framework tests need the test extra (torch, trl)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "grpo"))
import realmodel as R  # noqa: E402

CONTEXT = 256 << 10          # SimTorchMemory's default context: what a parked job keeps on the device


def capacity_for(alone: list[dict]) -> int:
    """Room for both contexts and one job's regions, never for both jobs' regions."""
    regions = [R.device_bytes(d) for d in alone]
    assert all(r > 0 for r in regions), regions
    return 2 * CONTEXT + max(regions) + min(regions) // 2


def holds(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["ev"] == "hold"]


def check_pair(alone: list[dict], sliced: list[dict]) -> None:
    for a, s in zip(alone, sliced):
        assert s["steps"] == a["steps"] and a["steps"] > 0
        assert s["losses"] == a["losses"], (s["job"], s["losses"], a["losses"])   # exact floats
        assert s["digest"] == a["digest"], s["job"]
        assert s["swaps"] >= 2, (s["job"], s["swaps"])      # paused and resumed at least once
        state = s["region_bytes"]["weights"] + s["region_bytes"]["optimizer"]
        assert state == s["state_bytes"] == a["state_bytes"]     # all of it in regions
        assert s["region_bytes"].get("graphs", 0) > 0 or s["generation"] == "eager"   # the dense cache too
        assert any(h["restored"] for h in holds(s)), s["job"]
    assert alone[0]["digest"] != alone[1]["digest"]        # two different jobs (seeds)


TRL_A = ["--seed", "1", "--steps", "2"]


def test_the_nan_stand_in_catches_a_phase_run_outside_the_hold(rl_stack, alone):
    """Negative control: job A's reward function runs the model while A is parked (a GPU phase
    outside the hold). It computes with NaN, and its weights end unlike those of A run alone.
    (The positive case, TRL pairs equal to their standalone runs in every regime, is
    tests/test_gpu_rl_real_dry_run.py.)"""
    (base,) = alone([("trl_job.py", "alone-a", TRL_A, True)])
    jobs, _agent = rl_stack(capacity_for([base, base]))
    stray, fine = jobs.run([("trl_job.py", "stray-a", [*TRL_A, "--stray", "--reward-s", "0.5"], False),
                            ("trl_job.py", "fine-b", ["--seed", "2", "--steps", "2"], False)])
    assert stray["stray"]["nan"] >= 1, stray["stray"]         # it computed with NaN weights
    assert stray["digest"] != base["digest"]                  # and the bit-equality check sees it
    assert fine["steps"] == 2 and fine["swaps"] >= 2


def test_two_plain_transformers_grpo_loops_time_sliced_equal_their_standalone_runs(rl_stack, alone):
    """Also: a job's optimizer state, made inside its first train hold, is on the agent's report
    before that hold ends. The agent's periodic refresh is made rarer than a phase here, so a
    grant planned on a report from before the growth would put the other job on a full device
    (its first optimizer step ran out of simulated memory: the CI failure this test once had)."""
    args_a, args_b = ["--seed", "1", "--steps", "3"], ["--seed", "2", "--steps", "3"]
    base = alone([("real_job.py", "alone-a", args_a, True), ("real_job.py", "alone-b", args_b, True)])
    jobs, _agent = rl_stack(capacity_for(base), agent_extra=("--refresh-interval", "9"))
    sliced = jobs.run([("real_job.py", "plain-a", args_a, False), ("real_job.py", "plain-b", args_b, False)])
    check_pair(base, sliced)


def test_two_trl_jobs_that_fit_share_the_device_without_a_swap(rl_stack, alone):
    """Room for both jobs: no job is ever paused for the other, not even at its first grant (before
    its model exists its footprint was unknown, and lockd emptied the device for it)."""
    base = alone([("trl_job.py", "alone-a", TRL_A, True), ("trl_job.py", "alone-b", ["--seed", "2", "--steps", "2"],
                                                               True)])
    jobs, _agent = rl_stack(4 * (2 * CONTEXT + sum(d["state_bytes"] for d in base)))
    sliced = jobs.run([("trl_job.py", "fit-a", TRL_A, False),
                       ("trl_job.py", "fit-b", ["--seed", "2", "--steps", "2"], False)])
    for a, s in zip(base, sliced):
        assert s["losses"] == a["losses"] and s["digest"] == a["digest"], s["job"]
        assert s["swaps"] == 0, (s["job"], s["swaps"])                   # never paused
        assert not any(h["restored"] for h in holds(s)), s["job"]
    assert any(h["elided"] for d in sliced for h in holds(d))            # they did share the device
