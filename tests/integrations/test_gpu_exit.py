"""On a real GPU: a job that used torch-memory-saver regions ends with its own exit status.

The H200 runs of the TRL job (examples/grpo/trl_job.py) finished their work, then exited 1
at interpreter teardown with ``[torch_memory_saver.cpp] only support interesting region ...
func=tms_torch_free``; the examples hid it with ``os._exit(0)``. timeslice/torch_release.py
says why and what TorchMemory now does (release at ``close()``, detach at exit). Here:

* the probe: a small CUDA process with TorchMemory regions (a block kept, blocks freed into
  the region's pool) ended four ways: left as it is, after ``close()``, parked (regions
  released), and, as the negative control, torch-memory-saver alone, which must still exit 1
  with that line (if it no longer does, the upstream rule changed: read the output);
* the TRL job, standalone and as a time-sliced pair through lockd and a node agent on the
  driver backend, run to its normal end: exit status 0, no torch-memory-saver error line,
  and the pair's losses and weights bit-identical to the standalone runs.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_gpu_exit.py -s   # ~3 min
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from timeslice.nodeagent.backends import cuda_driver

_ok, _why = cuda_driver.probe()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _ok, reason=f"no usable CUDA driver API: {_why}"),
    pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None, reason="torch-memory-saver missing"),
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl missing"),
]

PROBE = '''
import sys
import torch
mode = sys.argv[1]
if mode == "saver-alone":                  # the negative control: torch-memory-saver as a job would use it
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"
    with tms.region(tag="weights"):
        kept = torch.ones(64 << 20, device="cuda")
        tmp = torch.ones(64 << 20, device="cuda")
    del tmp                                # freed into the region's pool: a cached block
    torch.cuda.synchronize()
    print("done", flush=True)
    sys.exit(0)

from timeslice.torch_memory import TorchMemory
memory = TorchMemory({"weights": "offload", "optimizer": "offload"})
with memory.region("weights"):
    kept = torch.ones(64 << 20, device="cuda")
with memory.region("optimizer"):
    state = torch.ones(32 << 20, device="cuda")
    tmp = torch.ones(64 << 20, device="cuda")
del tmp
torch.cuda.synchronize()
if mode == "close":
    memory.close()
    assert float(kept.sum()) == float(64 << 20)       # what the job holds stays readable after close
elif mode == "parked":
    memory.pause(["weights", "optimizer"])
print("done", flush=True)
sys.exit(0)
'''


def _probe(tmp_path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    return subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["as-is", "close", "parked"])
def test_a_process_with_regions_exits_zero(tmp_path, mode):
    p = _probe(tmp_path, mode)
    print(f"\n{mode}: rc={p.returncode}\n{p.stderr[-2000:]}")
    assert "done" in p.stdout, p.stderr[-3000:]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "torch_memory_saver.cpp" not in p.stderr, p.stderr[-3000:]


def test_negative_control_torch_memory_saver_alone_still_exits_one(tmp_path):
    p = _probe(tmp_path, "saver-alone")
    print(f"\nsaver-alone: rc={p.returncode}\n{p.stderr[-2000:]}")
    assert "done" in p.stdout, p.stderr[-3000:]
    assert p.returncode == 1 and "only support interesting region" in p.stderr, (
        "torch-memory-saver alone no longer fails at teardown: its rule changed, see timeslice/torch_release.py",
        p.returncode, p.stderr[-3000:])


TRL_A, TRL_B = ["--seed", "1", "--steps", "3", "--device", "cuda"], ["--seed", "2", "--steps", "3", "--device", "cuda"]


def test_trl_jobs_run_to_their_normal_end_with_status_zero(rl_stack, alone, tmp_path):
    """Standalone and time-sliced (cooperative, driver backend): every job exits 0 (Jobs.wait checks)."""
    base = alone([("trl_job.py", "alone-a", TRL_A, True), ("trl_job.py", "alone-b", TRL_B, True)])
    jobs, _agent = rl_stack(0, backend="cuda-driver")
    sliced = jobs.run([("trl_job.py", "trl-a", TRL_A, False), ("trl_job.py", "trl-b", TRL_B, False)], timeout=400)
    for log in tmp_path.glob("*.log"):
        assert "torch_memory_saver.cpp" not in log.read_text(errors="replace"), log.name
    for a, s in zip(base, sliced):
        print(f"\n{s['job']}: steps {s['steps']}, swaps {s['swaps']}, losses equal {s['losses'] == a['losses']}")
        assert s["losses"] == a["losses"] and s["digest"] == a["digest"], s["job"]
