"""The driver-API backend's ctypes plumbing, against a compiled stand-in for libcuda.

Same symbols, signatures and argument structs as the driver (fake_libcuda.c);
checks that arguments arrive intact, results map to the typed errors, and the
ops layer drives it end to end. Skipped where no C compiler is available.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from timeslice.common import device_errors as e
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.cuda_driver import CudaDriver, CudaDriverBackend
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.records import SnapshotRecords

GiB = 1 << 30
SRC = Path(__file__).with_name("fake_libcuda.c")
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler for the libcuda stand-in")


class Meter:
    """NVML's answers: 1 GiB per process until checkpointed, 10 GiB free."""

    def __init__(self, lib):
        self.lib = lib
        self.free_bytes = 10 * GiB

    def usage(self, pid):
        st = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(st))
        return {"GPU-fake": GiB} if rc == 0 and st.value in (0, 1) else {}

    def free(self):
        return {"GPU-fake": self.free_bytes}


@pytest.fixture(scope="module")
def libpath(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda-fake.so"
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(out), str(SRC)], check=True)
    return str(out)


@pytest.fixture
def proc():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def child(proc) -> int:
    return proc.pid


@pytest.fixture
def be(libpath, tmp_path):
    # dlopen hands every test the same library and so the same state tables;
    # each test works on its own child pid, so they do not interfere.
    drv = CudaDriver.load(libpath)
    return CudaDriverBackend(drv, meter=Meter(drv.lib), records=SnapshotRecords(tmp_path / "rec"))


def test_state_machine_through_ctypes(be, child):
    lib = be.driver.lib
    assert be.get_state(child) is ProcState.NO_CUDA
    lib.fakeAddProcess(child)
    assert be.get_state(child) is ProcState.RUNNING
    be.lock(child, 1234)
    lib.fakeLastTimeout.restype = ctypes.c_uint
    assert lib.fakeLastTimeout() == 1234          # the struct arrived with its timeout and zeroed reserves
    assert be.get_state(child) is ProcState.LOCKED
    assert be.checkpoint(child) == GiB
    assert be.get_state(child) is ProcState.CHECKPOINTED and be.snapshot_usage(child) == {"GPU-fake": GiB}
    assert be.restore(child) == GiB and be.snapshot_usage(child) is None
    be.unlock(child)
    assert be.get_state(child) is ProcState.RUNNING


def test_driver_errors_are_typed_with_their_names(be, child):
    lib = be.driver.lib
    lib.fakeAddProcess(child)
    lib.fakeSetBusy(child, 1)
    with pytest.raises(e.LockTimeout) as exc:
        be.lock(child, 100)
    assert exc.value.cu_name == "CUDA_ERROR_NOT_READY" and "device not ready" in str(exc.value)
    lib.fakeSetBusy(child, 0)
    with pytest.raises(e.IllegalState):
        be.unlock(child)
    with pytest.raises(e.NoCudaContext):
        be.lock(os.getpid(), 100)  # alive, never given CUDA


def test_ops_end_to_end_and_oom_restore_refused_up_front(be, child):
    lib = be.driver.lib
    lib.fakeAddProcess(child)
    snap = snapshot_processes(be, [child], lock_timeout_ms=500)
    assert snap.ok and snap.bytes == GiB
    be.meter.free_bytes = GiB  # not room for 1 GiB + headroom
    res = restore_processes(be, [child])
    assert res.refused and be.get_state(child) is ProcState.CHECKPOINTED
    be.meter.free_bytes = 10 * GiB
    lib.fakeSetDeviceFull(1)   # admission passed but the driver still says no
    res = restore_processes(be, [child])
    assert res.by_pid()[child].outcome is Outcome.FAILED and res.by_pid()[child].error_code == "RESOURCE_EXHAUSTED"
    lib.fakeSetDeviceFull(0)
    assert restore_processes(be, [child]).ok
    assert be.get_state(child) is ProcState.RUNNING


def test_gone_pid_never_reaches_the_driver(be, proc, child):
    be.driver.lib.fakeAddProcess(child)
    proc.kill()
    proc.wait()
    assert be.get_state(child) is ProcState.GONE
    with pytest.raises(e.ProcessGone):
        be.lock(child, 100)
