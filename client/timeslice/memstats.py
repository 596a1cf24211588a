"""What a job's framework says about its device memory, for the footprint its grants admit.

The lock plans a grant with what the job needs (README, "Memory a grant admits"): the
largest allocator peak of its holds and the memory its process holds outside the
allocator (the CUDA context, workspaces, loaded kernels). The client measures both at
each yield, from the job's own figures, and sends them with its next Acquire
(``peak_bytes``, ``context_bytes``). Any framework can say it by implementing
``DeviceStats``, a small protocol with no import of its own:

* ``reset_peak()``: a hold starts; the peak counts from now (a framework without a
  reset keeps its lifetime peak: a larger figure, never a wrong one);
* ``allocator_peak_bytes()``: the allocator's largest reservation since then;
* ``allocator_bytes()``: its reservation now;
* ``device_used_bytes()``: the device meter's figure for this process (NVML), or None
  where the process cannot read it (another pid namespace, no NVML).

``TorchMemory``, the simulated device's memories and ``TorchStats`` (below: torch's
caching allocator, for a job that does not cooperate) implement it; a JAX memory
would answer from ``device.memory_stats()``. ``measure`` turns a ``DeviceStats`` into the
two figures. PyTorch and NVML are imported lazily, here only in ``TorchStats``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from timeslice.logs import get_logger

log = get_logger(__name__)


@runtime_checkable
class DeviceStats(Protocol):
    def reset_peak(self) -> None: ...
    def allocator_peak_bytes(self) -> int: ...
    def allocator_bytes(self) -> int: ...
    def device_used_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class Measure:
    peak_bytes: int = 0          # the allocator's largest reservation in the hold
    context_bytes: int = 0       # the process's memory outside the allocator (0: cannot say)


def measure(stats: DeviceStats) -> Measure:
    """The hold's figures from ``stats``; a framework that fails to say costs the figure, never the yield."""
    try:
        peak = max(0, int(stats.allocator_peak_bytes()))
        used = stats.device_used_bytes()
        ctx = max(0, int(used) - int(stats.allocator_bytes())) if used is not None else 0
    except Exception:  # best effort: the declaration still stands
        log.warning("memory_stats_failed", exc_info=True)
        return Measure()
    return Measure(peak, ctx)


def reset(stats: DeviceStats) -> None:
    try:
        stats.reset_peak()
    except Exception:  # best effort, as above
        log.warning("memory_stats_reset_failed", exc_info=True)


def nvml_process_bytes(uuid: str, pid: int | None = None) -> int | None:
    """NVML's used memory of process ``pid`` (default: this one) on the GPU ``uuid``; None where
    NVML cannot say (not installed, no driver, another pid namespace)."""
    pid = os.getpid() if pid is None else pid
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except Exception:  # best effort: the allocator's count stands in
        return None
    return None


class TorchStats:
    """``DeviceStats`` of torch's caching allocator on one CUDA device (default: the current one
    when first asked). Note that ``reset_peak`` resets torch's peak statistics for that device,
    which a job's own logging of ``torch.cuda.max_memory_*`` then sees per hold."""

    def __init__(self, device: int | None = None):
        import torch
        self._cuda = torch.cuda
        self.device = torch.cuda.current_device() if device is None else int(device)
        self._uuid = ""

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)

    def allocator_peak_bytes(self) -> int:
        return int(self._cuda.max_memory_reserved(self.device))

    def allocator_bytes(self) -> int:
        return int(self._cuda.memory_reserved(self.device))

    def device_used_bytes(self) -> int | None:
        if not self._uuid:
            uuid = str(self._cuda.get_device_properties(self.device).uuid)
            self._uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return nvml_process_bytes(self._uuid)


def default_stats() -> DeviceStats | None:
    """``TorchStats`` where the job has imported torch and initialised CUDA; else None. Never
    imports torch itself, so a CPU-only job pays nothing and no CUDA context is made by accident."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return TorchStats()
    except Exception:  # a broken CUDA setup costs the figures, never the hold
        return None
