"""NVML, for what the checkpoint API does not say: who holds how much device memory.

Used for admission (bytes per process and free bytes per GPU, keyed by GPU
UUID), for discovery (compute-process pids) and for the agent's capabilities
(GPU inventory). ``pynvml`` comes from the ``nvidia-ml-py`` package; on a
machine without the NVIDIA driver ``Nvml.open()`` raises ``BackendUnavailable``
and callers carry on without it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from timeslice.common.device_errors import BackendUnavailable

_lock = threading.Lock()
_refs = 0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    total_bytes: int
    free_bytes: int


class Nvml:
    """A reference-counted NVML session (nvmlInit/nvmlShutdown are process-wide)."""

    def __init__(self):
        import pynvml  # imported lazily: importing this module must never fail
        self._n = pynvml
        self._closed = False

    @classmethod
    def open(cls) -> Nvml:
        global _refs
        try:
            inst = cls()
            with _lock:
                inst._n.nvmlInit()
                _refs += 1
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, ...
            raise BackendUnavailable(f"NVML unavailable: {exc}") from exc
        return inst

    def close(self) -> None:
        global _refs
        with _lock:
            if self._closed:
                return
            self._closed = True
            _refs -= 1
            if _refs == 0:
                self._n.nvmlShutdown()

    def _handles(self):
        n = self._n
        return [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]

    def _uuid(self, h) -> str:
        u = self._n.nvmlDeviceGetUUID(h)
        return u.decode() if isinstance(u, bytes) else u

    def gpus(self) -> list[Gpu]:
        out = []
        for i, h in enumerate(self._handles()):
            mem = self._n.nvmlDeviceGetMemoryInfo(h)
            out.append(Gpu(i, self._uuid(h), int(mem.total), int(mem.free)))
        return out

    def free_by_uuid(self) -> dict[str, int]:
        return {g.uuid: g.free_bytes for g in self.gpus()}

    def utilization(self) -> dict[str, float]:
        """GPU index -> fraction of the last sample period a kernel ran (NVML utilization.gpu / 100)."""
        return {str(i): self._n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for i, h in enumerate(self._handles())}

    def _procs(self, h):
        n = self._n
        # Compute contexts are what the checkpoint API moves; graphics contexts
        # are listed too because a process can hold memory through either.
        seen = {}
        for fn in (n.nvmlDeviceGetComputeRunningProcesses, n.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in fn(h):
                    seen[p.pid] = p
            except n.NVMLError_NotSupported:
                continue
        return seen.values()

    def usage_of(self, pid: int) -> dict[str, int] | None:
        """Bytes ``pid`` holds per GPU UUID; {} if it holds none; None if NVML cannot say."""
        out: dict[str, int] = {}
        for h in self._handles():
            for p in self._procs(h):
                if p.pid != pid:
                    continue
                used = p.usedGpuMemory
                if used is None:  # NVML_VALUE_NOT_AVAILABLE (e.g. no access to the pid)
                    return None
                out[self._uuid(h)] = out.get(self._uuid(h), 0) + int(used)
        return out

    def compute_pids(self) -> dict[int, dict[str, int]]:
        """Every pid holding device memory -> its bytes per GPU UUID (0 if not reported)."""
        out: dict[int, dict[str, int]] = {}
        for h in self._handles():
            uuid = self._uuid(h)
            for p in self._procs(h):
                out.setdefault(p.pid, {})[uuid] = int(p.usedGpuMemory or 0)
        return out


class NvmlMeter:
    """Device usage and free memory from NVML, opened on first use.

    Answers None (unknowable) when NVML is missing, so that admission refuses
    rather than guesses.
    """

    def __init__(self):
        self._nvml: Nvml | None = None
        self._mu = threading.Lock()

    def _get(self) -> Nvml | None:
        with self._mu:
            if self._nvml is None:
                try:
                    self._nvml = Nvml.open()
                except BackendUnavailable:
                    return None
            return self._nvml

    def usage(self, pid: int) -> dict[str, int] | None:
        n = self._get()
        return None if n is None else n.usage_of(pid)

    def free(self) -> dict[str, int] | None:
        n = self._get()
        return None if n is None else n.free_by_uuid()

    def processes(self) -> dict[int, dict[str, int]] | None:
        """Every pid holding device memory -> its bytes per GPU UUID; None without NVML."""
        n = self._get()
        return None if n is None else n.compute_pids()

    def close(self) -> None:
        with self._mu:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
