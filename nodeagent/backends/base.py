"""The one interface every checkpoint backend implements.

A backend moves *one process's* device context between the device and host
memory, with the CUDA checkpoint state machine:

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

Calls are **blocking and thread-safe**: a checkpoint of a large context takes
seconds, and the several processes of one job are driven from several threads
at once (``nodeagent.backends.ops``). Async callers use ``asyncio.to_thread``,
or the async wrappers in ``ops``; the backends themselves never touch an event
loop, which keeps them usable from the CLI stand-in and from benchmarks.

Besides the state machine, a backend answers the two questions admission needs
(``nodeagent.hostmem``): how many bytes a process holds on which device, and
how much each device has free. Device ids are strings (GPU UUIDs on NVIDIA,
``sim0`` on the simulator). The size of a checkpointed process is recorded at
checkpoint time, durably, because after the checkpoint the device no longer
shows it and a restore must know it before it starts.
"""
from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from typing import Protocol


class ProcState(str, enum.Enum):
    """A process's checkpoint state, as the agent reports it (lower-case in etcd/proto)."""

    RUNNING = "running"            # on the device, free to run
    LOCKED = "locked"              # on the device, CUDA calls blocked
    CHECKPOINTED = "checkpointed"  # device memory copied to host and released
    FAILED = "failed"              # driver says the context is unusable
    GONE = "gone"                  # the process does not exist (any more)
    NO_CUDA = "no_cuda"            # alive, but has no CUDA context: nothing to move
    UNKNOWN = "unknown"            # the backend could not tell
    # A cooperative worker paused in part (a selective swap released some of its regions and kept
    # the others on the device): parked like CHECKPOINTED, yet a further pause can free more.
    PARTIAL = "partial"

    def __str__(self) -> str:  # so f-strings and JSON show "running", not the class
        return self.value


# A mapping device id -> bytes.
DeviceBytes = Mapping[str, int]


class DeviceMeter(Protocol):
    """Where a backend's sizes come from (NVML on NVIDIA, the ledger on the simulator)."""

    def usage(self, pid: int) -> DeviceBytes | None: ...
    def free(self) -> DeviceBytes | None: ...


class Backend(abc.ABC):
    """A checkpoint backend. Subclasses set ``name``; ``pick_backend`` sets ``why``."""

    name: str = "abstract"
    why: str = ""
    # Extra free bytes a restore needs beyond the recorded snapshot, per device
    # (see nodeagent.hostmem.admit_restore). Real drivers rebuild a context.
    restore_headroom_bytes: int = 0
    meter: DeviceMeter | None = None     # who measures device memory here (NVML, the simulated device's meter)

    # -- per-op context -----------------------------------------------------
    def prepare(self, op: str, pids: Sequence[int], isolation: str = "", need_bytes: int = 0) -> None:  # noqa: B027
        """Called by the runner before ``op`` on ``pids``: the group's isolation and the device bytes
        the incoming job needs here (0: all). A whole-process checkpoint needs neither (a no-op);
        the cooperative swaps use both (``nodeagent.backends.composite``). Blocking."""

    def finish(self, pids: Sequence[int]) -> None:  # noqa: B027
        """``prepare``'s pair: called once the op on ``pids`` ended, whether or not it (or
        ``prepare``) failed, to drop what ``prepare`` kept."""

    # -- the state machine -------------------------------------------------
    @abc.abstractmethod
    def get_state(self, pid: int) -> ProcState:
        """Current state. Never raises for a missing process (GONE) or one without CUDA (NO_CUDA)."""

    @abc.abstractmethod
    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED, waiting at most ``timeout_ms`` for in-flight work.

        Raises ``LockTimeout`` (process left RUNNING), ``ProcessGone``, ``NoCudaContext``,
        ``IllegalState``.
        """

    @abc.abstractmethod
    def checkpoint(self, pid: int) -> int:
        """LOCKED -> CHECKPOINTED. Records the size durably, returns the bytes moved.

        Device memory is released only after the host copy is complete.
        """

    @abc.abstractmethod
    def restore(self, pid: int) -> int:
        """CHECKPOINTED -> LOCKED. Returns the bytes moved back.

        Does *not* check for room first: callers admit restores with
        ``nodeagent.hostmem.admit_restore`` (a restore that fails for lack of
        device memory loses the context on the real driver).
        """

    @abc.abstractmethod
    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""

    # -- sizes, for admission ----------------------------------------------
    def device_usage(self, pid: int) -> DeviceBytes | None:
        """Bytes ``pid`` holds now, per device; {} if none; None if unknowable (the meter's word)."""
        return self.meter.usage(pid) if self.meter is not None else None

    def device_free(self) -> DeviceBytes | None:
        """Free bytes per device; None if unknowable (the meter's word)."""
        return self.meter.free() if self.meter is not None else None

    @abc.abstractmethod
    def snapshot_usage(self, pid: int) -> DeviceBytes | None:
        """Per-device bytes recorded when ``pid`` was checkpointed; None if no record."""

    def device_bytes(self, pid: int) -> int | None:
        """Total device bytes ``pid`` holds now, when knowable."""
        usage = self.device_usage(pid)
        return None if usage is None else sum(usage.values())

    def host_bytes_needed(self, pid: int) -> int | None:
        """Host memory a snapshot of ``pid`` will newly take (admission); None if unknowable.

        A whole-process checkpoint copies everything the process holds on the
        device; a cooperative worker with a retained host backup needs nothing new.
        """
        return self.device_bytes(pid)

    def snapshot_bytes(self, pid: int) -> int | None:
        usage = self.snapshot_usage(pid)
        return None if usage is None else sum(usage.values())

    def reap(self) -> list[int]:
        """Forget what exited processes left behind (the simulator's files); returns their pids."""
        return []

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing
        """Release what the backend holds (library handles, files). Idempotent."""

    def describe(self) -> dict:
        """Capabilities for the agent's liveness key."""
        return {"backend": self.name, "why": self.why}
