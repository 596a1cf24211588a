"""SIMULATED GPU, worker side: what an RL worker process uses instead of CUDA.

    dev = SimDeviceClient.open(sim_dir, gpu=0)   # register this process, bound to simulated GPU 0
    buf = dev.alloc(nbytes)                  # reserve device capacity, map the arena
    with dev.compute() as mem:               # a "kernel": touch device memory only in here
        mem[0:4] = b"abcd"
    dev.checksum()                           # sha256 of the device bytes
    dev.device_bytes                         # bytes this process holds on the device
    dev.free(); dev.close()

Like CUDA under the checkpoint API, every device operation blocks while the
agent has the process locked or checkpointed, and resumes once it is restored
and unlocked. Device memory must only be touched inside ``compute()``: outside
it the agent may have released the arena (touching it then faults, much as a
stale device pointer would).

As a GPU does, the device charges the process more than it asked for
(``timeslice.common.sim.device``): a context and the allocator's slack, real
bytes of the arena (a checkpoint moves them). The allocator's own figures
(``allocator_bytes``: what torch's ``memory_reserved`` would say) leave the
context out; ``device_bytes`` (the agent's meter, NVML) counts it. A holding
that does not fit raises ``DeviceOutOfMemory`` with a CUDA-like message.
``DeviceStats`` (``timeslice.memstats``) is implemented from these figures.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from timeslice.common.device_errors import IllegalState
from timeslice.common.sim.device import ENV_SIM_GPU, RUNNING, SimDevice

POLL_S = 0.002  # how often a blocked device call looks at the state again


@dataclass(frozen=True)
class SimBuffer:
    """Handle of an allocated arena (the worker's "device pointer")."""

    pid: int
    nbytes: int


class SimDeviceClient:
    def __init__(self, dev: SimDevice, pid: int, gpu: int = 0):
        self.dev = dev
        self.pid = pid
        self.gpu = gpu
        self._mm: mmap.mmap | None = None
        self._nbytes = 0                 # bytes the program asked for in its arena
        self._arena = 0                  # the arena's size: the context, those bytes and their slack
        self._extra = 0                  # allocator bytes held beside the arena (a memory's regions)
        self._peak = 0                   # the allocator's largest reservation since reset_peak

    @classmethod
    def open(cls, sim_dir: str | os.PathLike | None = None, gpu: int | None = None) -> SimDeviceClient:
        """Register the calling process on the node's simulated device, bound to GPU ``gpu``
        (default: ``TIMESLICE_SIM_GPU``, else 0), as a real worker picks its CUDA device."""
        dev = SimDevice(sim_dir)
        if gpu is None:
            raw = os.environ.get(ENV_SIM_GPU, "")
            gpu = int(raw) if raw.strip() else 0
        pid = os.getpid()
        dev.register(pid, gpu)
        return cls(dev, pid, gpu)

    @property
    def device_bytes(self) -> int:
        """What the device's meter shows for this process (NVML): context, slack and all."""
        return self.dev.held(self.pid)

    @property
    def arena_bytes(self) -> int:
        return self._arena

    # -- DeviceStats (timeslice.memstats): the simulated allocator's own figures ---------------
    def allocator_bytes(self) -> int:
        """What the allocator holds now (its slack included, the context not)."""
        return self.dev.allocator_bytes(self._nbytes) + self._extra

    def allocator_peak_bytes(self) -> int:
        return max(self._peak, self.allocator_bytes())

    def reset_peak(self) -> None:
        self._peak = self.allocator_bytes()

    def device_used_bytes(self) -> int | None:
        return self.device_bytes

    def hold(self, extra: int) -> None:
        """Set the allocator bytes this process holds beside its arena (a memory's regions, with their
        slack): DeviceOutOfMemory if the whole holding does not fit, and then nothing changes."""
        self._reserve(self._arena, extra)
        self._extra = extra

    def _reserve(self, arena: int, extra: int) -> None:
        self.dev.ledger.reserve(self.pid, arena + extra, self.dev.is_dead, self.gpu)
        self._peak = max(self._peak, self.dev.allocator_bytes(self._nbytes) + extra)

    @contextlib.contextmanager
    def _device(self, timeout_s: float | None) -> Iterator[None]:
        """Hold the device lock shared while the state is RUNNING; wait otherwise.

        A fresh descriptor per operation: flock belongs to the open file, so two
        threads of one worker each get their own shared lock and neither can
        drop the other's. The worker only *reads* its state file: the agent is
        its one writer, so a worker can never overwrite a lock it has not seen.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            fd = os.open(self.dev.devlock(self.pid), os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                doc = self.dev.read_state(self.pid)
                if doc is not None and doc["state"] == RUNNING:
                    yield
                    return
            finally:
                os.close(fd)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"simulated device of pid {self.pid} stayed {doc and doc['state']}")
            time.sleep(POLL_S)

    def alloc(self, nbytes: int, timeout_s: float | None = None) -> SimBuffer:
        """Reserve ``nbytes`` of device capacity (DeviceOutOfMemory if it does not fit).

        One arena per process; allocate once. The returned handle is like a
        device pointer: its bytes are reached through ``compute()``.
        """
        if self._mm is not None:
            raise IllegalState("this simulated device client already holds an arena", pid=self.pid)
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        # The arena holds the context the device charges this process and the allocator's slack too:
        # real bytes, so a checkpoint moves them as the driver moves a context.
        arena = self.dev.context_bytes + self.dev.allocator_bytes(nbytes)
        with self._device(timeout_s):
            self._reserve(arena, self._extra)
            fd = os.open(self.dev.arena(self.pid), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, arena)
                self._mm = mmap.mmap(fd, arena)
            finally:
                os.close(fd)
            self._nbytes, self._arena = nbytes, arena
        self._peak = max(self._peak, self.allocator_bytes())
        return SimBuffer(self.pid, nbytes)

    @contextlib.contextmanager
    def compute(self, timeout_s: float | None = None) -> Iterator[memoryview]:
        """A device operation: yields the arena, blocking while locked/checkpointed."""
        if self._mm is None:
            raise IllegalState("no arena allocated", pid=self.pid)
        with self._device(timeout_s):
            whole = memoryview(self._mm)
            ctx = self.dev.context_bytes
            view = whole[ctx:ctx + self._nbytes]           # what the program allocated (not the context)
            try:
                yield view
            finally:
                view.release()
                whole.release()

    def checksum(self, timeout_s: float | None = None) -> str:
        with self.compute(timeout_s) as mem:
            return hashlib.sha256(mem).hexdigest()

    def free(self) -> None:
        if self._mm is None:
            return
        with self._device(None):
            self._mm.close()
            self._mm = None
            try:
                os.unlink(self.dev.arena(self.pid))
            except FileNotFoundError:
                pass
            self.dev.ledger.release(self.pid)
            self._nbytes = self._arena = self._extra = 0

    def close(self) -> None:
        """Free the arena and unregister (the process stays alive, without a device)."""
        self.free()
        self.dev.forget(self.pid)
