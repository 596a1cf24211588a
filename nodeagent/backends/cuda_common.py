"""What the two real CUDA backends share: liveness, size records, NVML sizes.

The driver-API backend and the ``cuda-checkpoint`` backend differ only in how
they reach the driver. Both subclass ``CudaCheckpointBackend`` and implement
five raw calls (``_state``, ``_lock``, ``_checkpoint``, ``_restore``,
``_unlock``) that raise the typed errors of ``curesult.error_for``. This class
adds, around them:

* a pid that does not exist is GONE / ``ProcessGone`` (the driver says
  OPERATING_SYSTEM for it, which would otherwise read as a lost context);
* the process's per-GPU usage is measured after the lock and recorded durably
  *before* the checkpoint starts, because afterwards nothing on the device
  shows it and a restore needs it first (``records.SnapshotRecords``);
* the record is dropped once the process is back on the device.
"""
from __future__ import annotations

import abc

from timeslice.common import device_errors as e
from timeslice.common import procfs
from timeslice.nodeagent.backends.base import Backend, DeviceMeter, ProcState
from timeslice.nodeagent.backends.records import SnapshotRecords
from timeslice.nodeagent.hostmem import DEFAULT_DEVICE_HEADROOM_BYTES


class CudaCheckpointBackend(Backend):
    restore_headroom_bytes = DEFAULT_DEVICE_HEADROOM_BYTES

    def __init__(self, meter: DeviceMeter, records: SnapshotRecords, proc_root: str = procfs.PROC_ROOT):
        self.meter = meter
        self.records = records
        self.proc_root = proc_root

    # -- raw driver calls, provided by subclasses ---------------------------
    @abc.abstractmethod
    def _state(self, pid: int) -> ProcState: ...

    @abc.abstractmethod
    def _lock(self, pid: int, timeout_ms: int) -> None: ...

    @abc.abstractmethod
    def _checkpoint(self, pid: int) -> None: ...

    @abc.abstractmethod
    def _restore(self, pid: int) -> None: ...

    @abc.abstractmethod
    def _unlock(self, pid: int) -> None: ...

    # -- the interface ---------------------------------------------------------
    def _alive_or_raise(self, pid: int, op: str) -> None:
        if not procfs.is_alive(pid, self.proc_root):
            self.records.drop(pid)
            raise e.ProcessGone(f"{op} pid {pid}: no such process", pid=pid)

    def _call(self, op: str, pid: int, fn, *args):
        self._alive_or_raise(pid, op)
        try:
            return fn(pid, *args)
        except e.BackendError:
            # The process may have exited during the call; say so rather than
            # report the driver's confusing code for a missing pid.
            self._alive_or_raise(pid, op)
            raise

    def get_state(self, pid: int) -> ProcState:
        if not procfs.is_alive(pid, self.proc_root):
            return ProcState.GONE
        try:
            return self._state(pid)
        except e.NoCudaContext:
            return ProcState.NO_CUDA
        except e.BackendError:
            return ProcState.GONE if not procfs.is_alive(pid, self.proc_root) else ProcState.UNKNOWN

    def lock(self, pid: int, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive (0 would mean wait forever)")
        self._call("lock", pid, self._lock, timeout_ms)

    def checkpoint(self, pid: int) -> int:
        self._alive_or_raise(pid, "checkpoint")
        usage = self.device_usage(pid)
        if usage is None:
            raise e.SizeUnknown(f"checkpoint pid {pid}: device usage unknown; a later restore could not be "
                                "admitted, so the checkpoint is not started", pid=pid)
        self.records.put(pid, usage)
        try:
            self._call("checkpoint", pid, self._checkpoint)
        except BaseException:
            # Still on the device (LOCKED) or gone: the record would only mislead.
            if self._state_quiet(pid) is not ProcState.CHECKPOINTED:
                self.records.drop(pid)
            raise
        return sum(usage.values())

    def restore(self, pid: int) -> int:
        usage = self.records.get(pid)
        self._call("restore", pid, self._restore)
        self.records.drop(pid)
        return sum(usage.values()) if usage else 0

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid, self._unlock)

    def _state_quiet(self, pid: int) -> ProcState:
        try:
            return self.get_state(pid)
        except Exception:  # only used to decide cleanup
            return ProcState.UNKNOWN

    # -- sizes -------------------------------------------------------------------
    def snapshot_usage(self, pid: int):
        return self.records.get(pid)

    def close(self) -> None:
        close = getattr(self.meter, "close", None)
        if close:
            close()
