"""JAX jobs (benchmarks/gpu_jax_job.py) time-sliced through lockd and the node agent on the SIMULATED device
(real etcd), their state in ``SimJaxMemory``: JAX's CPU backend, a pause deletes the arrays. (The pair in
every regime, checkpoint and beside a TRL job: tests/test_gpu_jax_dry_run.py, the GPU benchmark's dry run.)

The negative control: a job whose reward function reads its weights while it is parked (a GPU phase
outside the hold) is stopped both ways: the read through the memory raises ``RegionReleased``, a
reference kept from the hold raises JAX's own "Array has been deleted". Neither computes, and the job
beside it is untouched: bit-identical to its standalone run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="needs the test extra (jax[cpu])")

JOB = str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_jax_job.py")
CONTEXT = 256 << 10          # SimJaxMemory's default context: what a parked job keeps on the device
TINY = ["--device", "cpu", "--steps", "2", "--batch", "8", "--generations", "4", "--seq-len", "8", "--vocab", "64",
        "--dim", "16", "--hidden", "32", "--layers", "2", "--reward-s", "0.3", "--lr", "1e-2"]


@pytest.fixture(scope="module", autouse=True)
def _one_compilation(tmp_path_factory):
    """The jobs share XLA's persistent cache (through the environment they inherit): each jitted step is
    compiled once, by the standalone run, not again in every job (CPU seconds CI does not have)."""
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_a_read_outside_the_hold_is_stopped_and_the_other_job_is_untouched(rl_stack, alone):
    (base_b,) = alone([(JOB, "alone-b", [*TINY, "--seed", "2"], True)])
    cap = 2 * CONTEXT + base_b["state_bytes"] + base_b["state_bytes"] // 2    # one job's state, never both
    jobs, _agent = rl_stack(cap)
    stray, fine = jobs.run([(JOB, "stray-a", [*TINY, "--seed", "1", "--stray"], False),
                            (JOB, "fine-b", [*TINY, "--seed", "2"], False)])
    assert stray["stray"]["calls"] == 2
    assert stray["stray"]["caught"] == ["RegionReleased", "RuntimeError"] * 2   # both reads, both steps
    assert stray["swaps"] >= 2 and fine["swaps"] >= 2                          # paused and resumed
    assert fine["losses"] == base_b["losses"] and fine["digest"] == base_b["digest"]
    assert sum(fine["region_bytes"].values()) == fine["state_bytes"] == base_b["state_bytes"]
    assert fine["backup"]["verified"] >= 1 and fine["backup"]["clean_mismatches"] == 0
    for job in (stray, fine):                          # the host backup was all there before the first hold
        assert job["first_pin"]["outside_any_hold"] and job["first_pin"]["host_bytes"] >= job["state_bytes"]
