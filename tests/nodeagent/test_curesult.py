"""Driver result codes -> typed errors; the driver API's argument layout; backend choice."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from timeslice.common import device_errors as e
from timeslice.nodeagent.backends import curesult, pick_backend
from timeslice.nodeagent.backends.cuda_driver import CheckpointArgs, CudaDriver, LockArgs, RestoreArgs, UnlockArgs


@pytest.mark.parametrize("code,op,cls", [
    (600, "lock", e.LockTimeout), (3, "get_state", e.NoCudaContext), (2, "restore", e.DeviceOutOfMemory),
    (304, "restore", e.ContextLost), (401, "checkpoint", e.IllegalState), (304, "lock", e.BackendError),
    (12345, "unlock", e.BackendError),
])
def test_error_for(code, op, cls):
    err = curesult.error_for(code, op, 77)
    assert type(err) is cls and err.pid == 77 and err.cu_result == code
    assert str(code) in str(err)


def test_code_from_text_by_name_or_description():
    assert curesult.code_from_text("Could not lock: CUDA_ERROR_NOT_READY") == 600
    assert curesult.code_from_text("lock failed: device not ready") == 600
    assert curesult.code_from_text("restore failed: OUT OF MEMORY") == 2
    assert curesult.code_from_text("Error: initialization error") == 3
    assert curesult.code_from_text("OS call failed or operation not supported on this OS") == 304
    assert curesult.code_from_text("segmentation fault") is None


def test_argument_structs_match_the_driver_headers():
    # Every checkpoint argument struct is 64 bytes; offsets per the CUDA driver API reference.
    for cls in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
        assert ctypes.sizeof(cls) == 64, cls
    assert LockArgs.timeoutMs.offset == 0 and LockArgs.reserved0.offset == 4 and LockArgs.reserved1.offset == 8
    assert RestoreArgs.gpuPairsCount.offset == 8 and RestoreArgs.reserved1.offset == 56
    assert bytes(LockArgs(timeoutMs=100))[:4] == (100).to_bytes(4, "little") and not any(bytes(UnlockArgs()))


def test_driver_backend_unavailable_without_libcuda():
    with pytest.raises(e.BackendUnavailable, match="cannot be loaded"):
        CudaDriver.load("libcuda-that-does-not-exist.so.1")


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine has libcuda")
def test_auto_falls_back_to_the_simulator_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    be = pick_backend("auto", sim_dir=tmp_path / "sim", capacity_bytes=1 << 20)
    assert be.name == "sim" and "SIMULATED" in be.why and "cuda-driver" in be.why
    assert be.describe()["simulated"] is True
    with pytest.raises(e.BackendUnavailable):
        pick_backend("cuda-driver")
    with pytest.raises(e.BackendUnavailable, match="unknown backend"):
        pick_backend("tpu")
    assert pick_backend("sim", sim_dir=tmp_path / "sim").why == "requested explicitly (sim)"
