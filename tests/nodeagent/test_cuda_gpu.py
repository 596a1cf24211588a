"""The driver-API backend on a real GPU: PyTorch workers off the GPU and back, intact.

Needs an NVIDIA GPU with driver r570+, NVML and torch; skipped otherwise. The
test process itself never initialises a CUDA context (only ``cuInit``), so
NVML's view of the GPU is the workers' alone.
"""
from __future__ import annotations

import importlib.util
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from timeslice.common.device_errors import LockTimeout
from timeslice.nodeagent.backends import cuda_driver
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.records import SnapshotRecords
from timeslice.nodeagent.hostmem import HostMemory

GiB = 1 << 30
WORKER = Path(__file__).with_name("torch_worker.py")
_ok, _why = cuda_driver.probe()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _ok, reason=f"no usable CUDA driver API: {_why}"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
]


class TorchWorker:
    def __init__(self, nbytes: int, seed: int, busy: bool = False):
        argv = [sys.executable, str(WORKER), "--bytes", str(nbytes), "--seed", str(seed)] + (["--busy"] if busy else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x.strip()) for x in self.proc.stdout], daemon=True).start()
        tag, pid, self.checksum, _ = self.read(120).split()
        assert tag == "READY" and int(pid) == self.pid

    def read(self, timeout: float = 60) -> str:
        return self.lines.get(timeout=timeout)

    def ask(self, cmd: str, timeout: float = 60) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def backend(tmp_path):
    be = cuda_driver.CudaDriverBackend(records=SnapshotRecords(tmp_path / "records"))
    yield be
    be.close()


@pytest.fixture
def workers():
    started: list[TorchWorker] = []

    def start(nbytes: int, seed: int, busy: bool = False) -> TorchWorker:
        w = TorchWorker(nbytes, seed, busy)
        started.append(w)
        return w
    yield start
    for w in started:
        w.stop()


def test_pytorch_worker_off_the_gpu_and_back(backend, workers):
    a, b = workers(2 * GiB, seed=1, busy=True), workers(2 * GiB, seed=2)
    held = backend.device_bytes(a.pid)
    assert held and held >= 2 * GiB, held

    snap = snapshot_processes(backend, [a.pid], lock_timeout_ms=10_000, host=HostMemory(reserve_bytes=GiB))
    r = snap.by_pid()[a.pid]
    # Measured again under the lock, so a kernel's scratch allocated since may count too.
    assert snap.ok and r.outcome is Outcome.DONE and r.bytes >= held, snap
    assert backend.get_state(a.pid) is ProcState.CHECKPOINTED
    assert (backend.device_bytes(a.pid) or 0) == 0          # NVML: its device memory is released
    assert backend.snapshot_bytes(a.pid) == r.bytes         # ...and its size is on record
    assert b.ask("verify") == f"VERIFY OK {b.checksum}"     # the other job runs meanwhile

    rest = restore_processes(backend, [a.pid])
    assert rest.ok and rest.by_pid()[a.pid].outcome is Outcome.DONE and rest.bytes == r.bytes, rest
    assert backend.get_state(a.pid) is ProcState.RUNNING
    assert a.ask("verify") == f"VERIFY OK {a.checksum}"
    assert backend.device_bytes(a.pid) >= 2 * GiB


def test_lock_times_out_on_queued_work_and_leaves_it_running(backend, workers):
    w = workers(256 << 20, seed=3)
    assert w.ask("hold 3000") == "HOLDING"
    t0 = time.monotonic()
    with pytest.raises(LockTimeout) as exc:
        backend.lock(w.pid, 100)
    assert exc.value.cu_result == 600 and time.monotonic() - t0 < 2.5
    assert backend.get_state(w.pid) is ProcState.RUNNING
    assert w.read() == "HELD"
    assert w.ask("verify") == f"VERIFY OK {w.checksum}"


def test_restore_without_room_is_refused_and_the_job_survives(backend, workers):
    a, b = workers(4 * GiB, seed=4), workers(1 * GiB, seed=5)
    assert snapshot_processes(backend, [a.pid], lock_timeout_ms=10_000, host=HostMemory(reserve_bytes=GiB)).ok
    free = sum(backend.device_free().values())
    assert b.ask(f"grab {free - 2 * GiB}", timeout=120).startswith("GRABBED")  # leave < the 4 GiB snapshot
    res = restore_processes(backend, [a.pid])
    assert res.refused and "restore refused" in res.error, res
    assert backend.get_state(a.pid) is ProcState.CHECKPOINTED  # untouched: not lost
    assert b.ask("release") == "RELEASED"
    assert restore_processes(backend, [a.pid]).ok
    assert a.ask("verify") == f"VERIFY OK {a.checksum}"
