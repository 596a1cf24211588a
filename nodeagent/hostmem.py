"""Admission: will the bytes fit where they are going? Asked before any process is touched.

Invariant 7 of docs/ARCHITECTURE.md (nothing lost) in code:

* a snapshot is refused up front unless host memory can take it: on the H200
  host we measured, two 75 GB snapshots at once made the kernel OOM-kill a
  job, and an OOM kill of a checkpointed process loses the job for good;
* a restore is refused up front unless every device it lands on has room for
  the *whole* recorded snapshot: a restore that fails for lack of device
  memory leaves the process checkpointed with its context lost.

"Free host memory" is ``MemAvailable`` from ``/proc/meminfo`` (the kernel's own
estimate of what can be allocated without swapping) minus a reserve kept for
everything else on the node. The reserve defaults to
``DEFAULT_HOST_RESERVE_BYTES`` and can be set with the environment variable
``TIMESLICE_HOST_RESERVE_BYTES``. ``proc_root`` is a parameter so tests can
point it at a fixture meminfo. ``pending`` (the agent passes the channel's
``pending_host_bytes``) is host memory that cooperative workers are reserving
right now for their pinned backups: promised, not yet visible in MemAvailable,
so it is taken off from the moment a reservation starts.

A cooperative worker asks before it pins a backup (``admit_pool``, the channel's
``host`` request): admitted, the bytes count as promised until the worker's own
state says the reservation ended; refused, the job is told why before anything is
mapped. Snapshots in flight (``promised``) count too, for their admitted need, so
two admissions never both take the same free memory: the kernel's OOM killer must
never be the one who decides.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from timeslice.common.device_errors import DeviceMemoryRefused, HostMemoryRefused
from timeslice.common.errors import ConfigError

ENV_HOST_RESERVE = "TIMESLICE_HOST_RESERVE_BYTES"
# 4 GiB: room for the kernel, the agent, the jobs' own host allocations growing
# while a swap is in flight. An operator with big hosts may want more.
DEFAULT_HOST_RESERVE_BYTES = 4 << 30
# Device headroom kept free on restore: the driver allocates a little beyond
# the process's recorded usage when it rebuilds a context. 256 MiB is more than
# a CUDA context's own footprint on the GPUs we know.
DEFAULT_DEVICE_HEADROOM_BYTES = 256 << 20


def read_meminfo(proc_root: str | os.PathLike = "/proc") -> dict[str, int]:
    """``/proc/meminfo`` as a dict of bytes (the kernel writes kB, meaning KiB)."""
    out: dict[str, int] = {}
    for line in (Path(proc_root) / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        value = int(parts[0])
        if len(parts) > 1 and parts[1] == "kB":
            value *= 1024
        out[key.strip()] = value
    return out


class HostMemory:
    """Free host memory as admission sees it: MemAvailable minus a reserve."""

    def __init__(self, proc_root: str | os.PathLike = "/proc", reserve_bytes: int | None = None,
                 pending: Callable[[], int] | None = None):
        if reserve_bytes is None:
            raw = os.environ.get(ENV_HOST_RESERVE)
            try:
                reserve_bytes = int(raw) if raw else DEFAULT_HOST_RESERVE_BYTES
            except ValueError:
                raise ConfigError(f"{ENV_HOST_RESERVE}={raw!r} is not a byte count") from None
        if reserve_bytes < 0:
            raise ConfigError(f"host memory reserve must be >= 0, got {reserve_bytes}")
        self.proc_root = proc_root
        self.reserve_bytes = reserve_bytes
        self.pending = pending
        self._inflight = 0                 # host bytes admitted snapshots are taking now
        self._mu = threading.Lock()

    def available_bytes(self) -> int:
        """Bytes a snapshot may take now (never negative)."""
        info = read_meminfo(self.proc_root)
        # MemAvailable exists since Linux 3.14; MemFree is the pessimistic fallback.
        avail = info.get("MemAvailable", info.get("MemFree", 0))
        return max(0, avail - self.reserve_bytes - self.pending_bytes())

    def pending_bytes(self) -> int:
        workers = max(0, int(self.pending())) if self.pending is not None else 0
        with self._mu:
            return workers + self._inflight

    @contextlib.contextmanager
    def promised(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` (an admitted snapshot's need) as taken while the body runs."""
        with self._mu:
            self._inflight += max(0, nbytes)
        try:
            yield
        finally:
            with self._mu:
                self._inflight -= max(0, nbytes)

    def admit_pool(self, need_bytes: int, own_pending: int = 0) -> tuple[bool, int, str]:
        """May a worker pin ``need_bytes`` of backup now? (ok, free bytes, why not). ``own_pending``: what
        this worker promised already (replaced by this request, so not counted twice)."""
        free = self.available_bytes() + max(0, own_pending)
        if need_bytes > free:
            return False, free, (f"pinned backup refused: needs {need_bytes} bytes of host memory, {free} free "
                                 f"(MemAvailable minus a {self.reserve_bytes}-byte reserve, snapshots in flight "
                                 "and other workers' reservations)")
        return True, free, ""

    def admit_snapshot(self, need_bytes: int) -> None:
        """Raise ``HostMemoryRefused`` unless ``need_bytes`` fit in free host memory."""
        free = self.available_bytes()
        if need_bytes > free:
            raise HostMemoryRefused(
                f"snapshot refused: needs {need_bytes} bytes of host memory, {free} free "
                f"(MemAvailable minus a {self.reserve_bytes}-byte reserve and {self.pending_bytes()} bytes "
                "being reserved by cooperative workers)",
                need_bytes=need_bytes, free_bytes=free)


def admit_restore(need: Mapping[str, int], free: Mapping[str, int] | None,
                  headroom_bytes: int = DEFAULT_DEVICE_HEADROOM_BYTES) -> None:
    """Raise ``DeviceMemoryRefused`` unless every device in ``need`` has room for it.

    ``need`` is the sum over all processes being restored together, per device:
    two processes restored in parallel onto one GPU must fit *together*.
    Unknown free memory (``None``) or a device that is not there refuses too:
    not knowing is not room.
    """
    for dev, nbytes in need.items():
        if nbytes <= 0:
            continue
        have = None if free is None else free.get(dev)
        if have is None:
            raise DeviceMemoryRefused(
                f"restore refused: free memory of device {dev} is unknown; {nbytes} bytes needed",
                need_bytes=nbytes, free_bytes=0)
        if nbytes + headroom_bytes > have:
            raise DeviceMemoryRefused(
                f"restore refused: device {dev} has {have} bytes free, the snapshot needs "
                f"{nbytes} + {headroom_bytes} headroom",
                need_bytes=nbytes + headroom_bytes, free_bytes=have)
