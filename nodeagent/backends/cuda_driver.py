"""The CUDA driver-API backend: ``cuCheckpointProcess*`` from ``libcuda.so.1`` through ctypes.

No extra binary and no CUDA toolkit needed, only the driver. The checkpoint
API appeared with driver r570 (CUDA 12.8, ``cuDriverGetVersion`` >= 12080).
The agent calls ``cuInit`` in its own process, which creates no context and
takes no device memory; the calls act on *other* processes by pid, so the
agent needs ptrace-level access to them (root, or hostPID + CAP_SYS_PTRACE in
Kubernetes).

Argument structs, from the driver API reference (each is 64 bytes; reserved
fields must be zero):

    CUcheckpointLockArgs       { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; }
    CUcheckpointCheckpointArgs { cuuint64_t reserved[8]; }        (first word: a pointer in newer headers)
    CUcheckpointRestoreArgs    { CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
                                 char reserved[52 - sizeof(pointer)]; cuuint64_t reserved1; }
    CUcheckpointUnlockArgs     { cuuint64_t reserved[8]; }

``CUprocessState``: 0 RUNNING, 1 LOCKED, 2 CHECKPOINTED, 3 FAILED. Importing
this module never fails; ``CudaDriver.load()`` raises ``BackendUnavailable``
with the reason when the library, the symbols or a GPU are missing.
"""
from __future__ import annotations

import ctypes
import threading

from timeslice.common.device_errors import BackendError, BackendUnavailable
from timeslice.nodeagent.backends import curesult
from timeslice.nodeagent.backends.base import DeviceMeter, ProcState
from timeslice.nodeagent.backends.cuda_common import CudaCheckpointBackend
from timeslice.nodeagent.backends.records import SnapshotRecords

MIN_DRIVER_VERSION = 12080
LIBCUDA = "libcuda.so.1"
CHECKPOINT_SYMBOLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                      "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
_STATES = {0: ProcState.RUNNING, 1: ProcState.LOCKED, 2: ProcState.CHECKPOINTED, 3: ProcState.FAILED}


class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.c_void_p), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CudaDriver:
    """The loaded driver: version, device count, and the five checkpoint calls (raising typed errors)."""

    _init_lock = threading.Lock()

    def __init__(self, lib: ctypes.CDLL, version: int, device_count: int):
        self.lib = lib
        self.version = version
        self.device_count = device_count

    @classmethod
    def load(cls, libname: str = LIBCUDA) -> CudaDriver:
        try:
            lib = ctypes.CDLL(libname)
        except OSError as exc:
            raise BackendUnavailable(f"{libname} cannot be loaded: {exc}") from exc
        missing = [s for s in CHECKPOINT_SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise BackendUnavailable(f"{libname} lacks {', '.join(missing)}: driver older than r570")
        ver = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(ver)) != 0 or ver.value < MIN_DRIVER_VERSION:
            raise BackendUnavailable(f"driver API version {ver.value} < {MIN_DRIVER_VERSION} (r570)")
        with cls._init_lock:
            rc = lib.cuInit(0)
        if rc != 0:
            raise BackendUnavailable(f"cuInit failed: {curesult.name_of(rc)} ({rc})")
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
        if rc != 0 or count.value == 0:
            raise BackendUnavailable(f"no CUDA device ({curesult.name_of(rc)}, count {count.value})")
        for sym in CHECKPOINT_SYMBOLS:
            getattr(lib, sym).restype = ctypes.c_int
        return cls(lib, ver.value, count.value)

    def _name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorString(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode(errors="replace")
        return ""

    def _check(self, rc: int, op: str, pid: int) -> None:
        if rc != 0:
            raise curesult.error_for(rc, op, pid, self._name(rc))

    def get_state(self, pid: int) -> ProcState:
        st = ctypes.c_int(-1)
        self._check(self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(st)), "get_state", pid)
        return _STATES.get(st.value, ProcState.UNKNOWN)

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = LockArgs(timeoutMs=timeout_ms)
        self._check(self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)), "lock", pid)

    def checkpoint(self, pid: int) -> None:
        args = CheckpointArgs()
        self._check(self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)), "checkpoint", pid)

    def restore(self, pid: int) -> None:
        args = RestoreArgs()
        self._check(self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)), "restore", pid)

    def unlock(self, pid: int) -> None:
        args = UnlockArgs()
        self._check(self.lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)), "unlock", pid)


class CudaDriverBackend(CudaCheckpointBackend):
    """The checkpoint state machine through the driver API (ctypes releases the GIL, so
    the threads of ``ops`` really run the calls in parallel)."""

    name = "cuda-driver"

    def __init__(self, driver: CudaDriver | None = None, meter: DeviceMeter | None = None,
                 records: SnapshotRecords | None = None, proc_root: str = "/proc"):
        from timeslice.nodeagent.backends.nvml import NvmlMeter
        self.driver = driver or CudaDriver.load()
        super().__init__(meter or NvmlMeter(), records or SnapshotRecords(proc_root=proc_root), proc_root)

    def describe(self) -> dict:
        return {**super().describe(), "driver_api_version": self.driver.version,
                "devices": self.driver.device_count}

    def _state(self, pid: int) -> ProcState:
        return self.driver.get_state(pid)

    def _lock(self, pid: int, timeout_ms: int) -> None:
        self.driver.lock(pid, timeout_ms)

    def _checkpoint(self, pid: int) -> None:
        self.driver.checkpoint(pid)

    def _restore(self, pid: int) -> None:
        self.driver.restore(pid)

    def _unlock(self, pid: int) -> None:
        self.driver.unlock(pid)


def probe() -> tuple[bool, str]:
    """(usable, why): can this machine run the driver-API backend?"""
    try:
        d = CudaDriver.load()
    except BackendError as exc:
        return False, str(exc)
    return True, f"{LIBCUDA} driver API {d.version} with checkpoint symbols, {d.device_count} GPU(s)"
