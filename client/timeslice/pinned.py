"""A pinned host pool for a job's retained backups, reserved fast and kept for the process lifetime.

Methods, fastest first, as measured on one H200 host (``benchmarks/results/gpu_pin_probe.json``,
``python -m benchmarks.gpu_pin_probe --gib 16 --big-gib 40 --stall-gib 16``):

=========  ====================================================================  ===================
``thp``    anonymous mmap, ``madvise(MADV_HUGEPAGE)``, faulted in by many         16 GiB 1.19 s (14.4 GB/s);
           threads (memset in chunks, the GIL released), ONE                     40 GiB 5.45 s cold,
           ``cudaHostRegister`` per slab (4 GiB; <= 64 GiB), the next slab        2.70 s warm
           faulted while the last one registers
``fault``  the same without transparent huge pages                               16 GiB 2.2 s (7.7 GB/s)
           (both: faulted in by ``madvise(MADV_POPULATE_WRITE)`` where the kernel
           has it, else by memset; the figures above are memset's)
``torch``  ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc) in 1 GiB slabs  16 GiB 6.5 s (2.7 GB/s)
=========  ====================================================================  ===================

``method="auto"`` takes the first that works here: ``thp`` where the kernel
offers transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled``
not ``[never]``), else ``fault``; if registering fails, ``torch``. Shared-memory
files with ``posix_fallocate`` then register were the slowest (1.4 GB/s): not offered.

When to pin. Pinning in one process did not slow another process's GPU work
(x1.003 for both ``torch`` and ``thp``), so a job may reserve while another
job holds the GPU: no gap between holds is needed. In the *same* process,
``torch`` pinning stalled that process's GPU work x4900 (cudaHostAlloc blocks
the device) and ``thp`` x1.12: so the reservation runs when the worker
cooperates, before its first acquire returns, never inside its own GPU phase
(``TorchMemory.prepin``).

One reservation at a time per host: processes take a file lock
(``TIMESLICE_PIN_LOCK``, default ``timeslice-pin.lock`` in /dev/shm) around
the pinning. Faulting is bound by the host's memory bandwidth, so two at once
each take about twice as long; one after the other, the first job is ready
(and can start its first hold) in half the time, the second no later.

Host accounting: before anything is mapped, ``admit(nbytes)`` (set by the
cooperative worker: its node agent's host admission, which counts every pool
and snapshot on the node) may refuse the reservation, so the kernel's OOM
killer never decides; ``pending_bytes()`` is what a reservation in progress has
promised and not finished; ``on_change`` is called when it starts and ends
(the cooperative worker tells its node agent, whose host admission subtracts
promised bytes from free memory from the moment a reservation starts).

Slabs are the unit of registration: a copy must stay inside one slab
(``backup.Extent``). PyTorch is imported lazily, and only by the ``torch``
method and ``view``; the libc side (map, advise, fault) needs none.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from timeslice.backup import BackupError, Extent, split_extents

log = structlog.get_logger(__name__)

GIB = 1 << 30
HUGE = 2 << 20                            # a transparent huge page on x86-64
MAX_SLAB = 64 * GIB                       # one cudaHostRegister call at most (vLLM measured larger calls failing)
PIPELINE_SLAB = 4 * GIB                   # default slab: the next one faults while this one registers
TORCH_SLAB = GIB                          # torch's host allocator rounds to powers of two: 1 GiB wastes none
METHODS = ("thp", "fault", "torch")
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV_PIN_LOCK = "TIMESLICE_PIN_LOCK"
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_EHWPOISON = 133                          # Linux's; Python's errno module does not name it

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

# register(addr, nbytes) -> None or raises; unregister(addr) -> None
Register = Callable[[int, int], None]
Unregister = Callable[[int], None]


class PinnedPoolError(BackupError):
    """No method could pin the host memory asked for (or the host does not have it)."""


def thp_available(sysfs: str = THP_SYSFS) -> bool:
    try:
        return "[never]" not in Path(sysfs).read_text()
    except OSError:
        return False


def mem_available(proc_root: str = "/proc") -> int:
    for line in (Path(proc_root) / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cuda_register(addr: int, nbytes: int) -> None:
    import torch
    err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    if int(err) != 0:
        raise PinnedPoolError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")


def cuda_unregister(addr: int) -> None:
    import torch
    torch.cuda.cudart().cudaHostUnregister(addr)


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    """madvise; 0 or the errno (ctypes drops the GIL for the call)."""
    return 0 if _libc.madvise(addr, nbytes, advice) == 0 else ctypes.get_errno()


_populate_works = [True]                  # cleared at the first EINVAL: a kernel before 5.14


def fault_in(addr: int, nbytes: int, threads: int) -> str:
    """Fault every page of [addr, addr+nbytes) in, from ``threads`` threads, one span each at a time.

    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+): the kernel allocates and zeroes the pages itself,
    huge pages where the range is advised so, with no write from us; the first touch of fresh host
    memory is what bounds a pin on a freshly started machine (2 GB/s measured there), and this halves
    the memory traffic of it (memset wrote every zeroed page a second time). Where the kernel does
    not know the advice, ``memset`` (drops the GIL too). Returns which of the two did it."""
    step = max(64 << 20, nbytes // max(1, threads * 4)) // HUGE * HUGE or HUGE
    spans = [(addr + o, min(step, nbytes - o)) for o in range(0, nbytes, step)]

    def one(span: tuple[int, int]) -> str:
        if _populate_works[0]:
            err = _madvise(span[0], span[1], _MADV_POPULATE_WRITE)
            if err == 0:
                return "populate"
            if err in (errno.ENOMEM, errno.EFAULT, _EHWPOISON):
                raise PinnedPoolError(f"the host could not give {span[1]} bytes of memory: {os.strerror(err)}")
            _populate_works[0] = False        # EINVAL (an older kernel), EPERM: the plain way
        ctypes.memset(span[0], 0, span[1])
        return "memset"
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="pin-fault") as ex:
        used = set(ex.map(one, spans))
    return "memset" if "memset" in used else "populate"


def default_lock_path() -> str:
    env = os.environ.get(ENV_PIN_LOCK)
    if env is not None:
        return env                         # "" turns the lock off
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "timeslice-pin.lock")


@contextlib.contextmanager
def host_lock(path: str) -> Iterator[None]:
    """One pinning at a time on this host (flock: released if the process dies)."""
    if not path:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                       # closing drops the lock


@dataclass
class Slab:
    nbytes: int
    addr: int = 0                         # libc mapping (thp/fault); 0 for torch slabs
    tensor: Any = None                    # torch slabs: the pinned tensor; others: a view, made lazily
    registered: bool = False


class PinnedPool:
    """Pinned host slabs, grown by ``reserve``; ``view(extent)`` is a CPU uint8 tensor over one piece."""

    def __init__(self, method: str = "auto", threads: int | None = None, register: Register | None = None,
                 unregister: Unregister | None = None, on_change: Callable[[], None] | None = None,
                 check_free: bool = True, max_slab: int = PIPELINE_SLAB, lock_path: str | None = None):
        if method not in ("auto", *METHODS):
            raise ValueError(f"method must be auto or one of {METHODS}, got {method!r}")
        self.method = method
        self.threads = threads or min(16, os.cpu_count() or 4)
        self._register, self._unregister = register or cuda_register, unregister or cuda_unregister
        self.on_change = on_change
        self.admit: Callable[[int], None] | None = None   # the node's host admission (raises to refuse)
        self.check_free = check_free
        self.max_slab = max(HUGE, min(max_slab, MAX_SLAB) // HUGE * HUGE)
        self.lock_path = default_lock_path() if lock_path is None else lock_path
        self.slabs: list[Slab] = []
        self._starts: list[int] = []
        self._pending = 0
        self.seconds = 0.0                # time spent reserving, all reservations
        self.faulted_by = ""              # how the last mapped slab was faulted in: populate | memset
        self.windows: list[tuple[float, float, int]] = []   # (monotonic start, end, bytes) of each reservation

    def size(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def pending_bytes(self) -> int:
        return self._pending

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:             # telling the agent is best effort; the hello repeats it
                log.warning("pinned_pool_announce_failed", exc_info=True)

    def reserve(self, nbytes: int) -> int:
        """Pin at least ``nbytes`` more; returns the logical offset of the new room."""
        at = self.size()
        if nbytes <= 0:
            return at
        nbytes = -(-nbytes // HUGE) * HUGE
        if self.check_free:
            free = mem_available()
            if nbytes > free:
                raise PinnedPoolError(f"the host has {free} bytes available, the backup pool needs {nbytes}")
        if self.admit is not None:
            self.admit(nbytes)            # the node agent counts it from now, or says why not: nothing mapped
        self._pending = nbytes
        self._changed()
        t0 = t1 = time.monotonic()
        try:
            with host_lock(self.lock_path):
                t1 = time.monotonic()
                self._reserve(nbytes)
        finally:
            dt = time.monotonic() - t1
            self._pending = 0
            self.seconds += dt
            self.windows.append((t1, t1 + dt, nbytes))
            self._changed()
        log.info("pinned_pool_reserved", bytes=nbytes, method=self.method, faulted_by=self.faulted_by,
                 slabs=len(self.slabs),
                 seconds=round(dt, 3), gb_s=round(nbytes / max(dt, 1e-9) / 1e9, 2),
                 waited_for_another_s=round(t1 - t0, 3))
        return at

    def _reserve(self, nbytes: int) -> None:
        order = ([m for m in METHODS if m != "thp" or thp_available()] if self.method == "auto"
                 else [self.method])
        last: Exception | None = None
        for m in order:
            try:
                made = self._torch_slabs(nbytes) if m == "torch" else self._mapped_slabs(nbytes, m == "thp")
            except Exception as e:        # this method does not work here: the next one may
                last = e
                log.warning("pinned_pool_method_failed", method=m, error=str(e)[:300])
                continue
            for s in made:
                self._starts.append(self.size())
                self.slabs.append(s)
            self.method = m               # later growth uses what worked
            return
        raise PinnedPoolError(f"no pinning method worked for {nbytes} bytes (tried {order}): {last}")

    def _mapped_slabs(self, nbytes: int, thp: bool) -> list[Slab]:
        """Map every slab, then fault slab i+1 in while slab i registers (one thread registers, in order).

        Registering is ~1/3 of a pinning on the H200 (40 GiB: 1.3 s of 5.5 s cold), and it pins
        pages that are already there; faulting is the host's memory bandwidth. Overlapping the two
        hides the registering behind the faulting of the next slab."""
        made: list[Slab] = []
        try:
            left = nbytes
            while left > 0:
                n = min(left, self.max_slab)
                addr = _libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise PinnedPoolError(f"mmap of {n} bytes failed: {os.strerror(ctypes.get_errno())}")
                s = Slab(n, int(addr))
                made.append(s)
                if thp and _libc.madvise(s.addr, n, _MADV_HUGEPAGE) != 0:
                    raise PinnedPoolError("madvise(MADV_HUGEPAGE) refused")
                left -= n
            with ThreadPoolExecutor(1, thread_name_prefix="pin-register") as reg:
                pending = []
                for s in made:
                    self.faulted_by = fault_in(s.addr, s.nbytes, self.threads) or self.faulted_by
                    pending.append(reg.submit(self._register_slab, s))
                for f in pending:
                    f.result()                   # the first failure, after every call has ended
        except BaseException:
            for s in made:
                self._free(s)
            raise
        return made

    def _register_slab(self, s: Slab) -> None:
        self._register(s.addr, s.nbytes)
        s.registered = True

    def _torch_slabs(self, nbytes: int) -> list[Slab]:
        import torch
        made = []
        left = nbytes
        while left > 0:
            n = min(left, TORCH_SLAB, self.max_slab)
            made.append(Slab(n, tensor=torch.empty(n, dtype=torch.uint8, pin_memory=True)))
            left -= n
        return made

    def split(self, offset: int, nbytes: int) -> list[Extent]:
        """[offset, offset+nbytes) of the logical pool as pieces that each lie in one slab."""
        return split_extents(self._starts, [s.nbytes for s in self.slabs], offset, nbytes)

    def view(self, e: Extent):
        """A CPU uint8 tensor over one piece (zero copy)."""
        s = self.slabs[e.slab]
        if s.tensor is None:
            import numpy as np
            import torch
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * s.nbytes).from_address(s.addr))
            s.tensor = torch.from_numpy(arr)
        return s.tensor[e.offset:e.offset + e.nbytes]

    def _free(self, s: Slab) -> None:
        s.tensor = None
        if s.registered:
            self._unregister(s.addr)
            s.registered = False
        if s.addr:
            _libc.munmap(s.addr, s.nbytes)
            s.addr = 0

    def close(self) -> None:
        """Give everything back (tests, probes; a job keeps its pool until it exits)."""
        for s in self.slabs:
            self._free(s)
        self.slabs, self._starts = [], []
