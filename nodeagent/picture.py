"""Where a job's context is on this node, read from its processes' real checkpoint state.

The agent never trusts its memory (or etcd) about a process: before an op,
after an op, on restart and on every refresh it asks the backend. ``take`` is
blocking (it calls the backend); call it through ``asyncio.to_thread``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodeagent.backends.base import Backend, ProcState
from tscore import records as R

_ON_DEVICE = (ProcState.RUNNING, ProcState.LOCKED)


def job_state(states: Mapping[int, ProcState]) -> str:
    """The status ``state`` of a job whose processes are in ``states``.

    Any checkpointed process makes the job snapshotted (it cannot run until
    restored, and a restore of the others is a no-op); a process the driver
    reports FAILED makes it lost.
    """
    live = [s for s in states.values() if s is not ProcState.GONE]
    if not live:
        return R.GONE
    if ProcState.FAILED in live:
        return R.LOST
    if ProcState.CHECKPOINTED in live:
        return R.SNAPSHOTTED
    return R.RUNNING


@dataclass(frozen=True)
class Picture:
    states: dict[int, ProcState] = field(default_factory=dict)
    resident_bytes: int = 0        # on the devices now
    snapshot_bytes: int = 0        # in host memory (recorded at checkpoint)

    @property
    def state(self) -> str:
        return job_state(self.states)

    @property
    def live_pids(self) -> list[int]:
        return sorted(p for p, s in self.states.items() if s is not ProcState.GONE)

    @property
    def device_bytes(self) -> int:
        """The job's footprint for its status: the snapshot size while snapshotted."""
        return self.snapshot_bytes if self.state == R.SNAPSHOTTED else self.resident_bytes

    def needs(self, op: str) -> bool:
        """True if ``op`` has something left to do (idempotency: otherwise report done)."""
        live = [s for s in self.states.values() if s is not ProcState.GONE]
        if ProcState.FAILED in live or ProcState.UNKNOWN in live:
            return True            # let the op report the failure with the backend's words
        todo = _ON_DEVICE if op == R.SNAPSHOT else (ProcState.CHECKPOINTED, ProcState.LOCKED)
        return any(s in todo for s in live)

    def describe(self) -> dict[str, str]:
        return {str(p): str(s) for p, s in sorted(self.states.items())}


def take(backend: Backend, pids: Iterable[int]) -> Picture:
    states: dict[int, ProcState] = {}
    resident = snap = 0
    for pid in sorted(set(pids)):
        s = backend.get_state(pid)
        states[pid] = s
        if s in _ON_DEVICE:
            resident += backend.device_bytes(pid) or 0
        elif s is ProcState.CHECKPOINTED:
            snap += backend.snapshot_bytes(pid) or 0
    return Picture(states, resident, snap)
