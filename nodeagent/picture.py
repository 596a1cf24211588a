"""Where a job's context is on this node, read from its processes' real checkpoint state.

The agent never trusts its memory (or etcd) about a process: before an op,
after an op, on restart and on every refresh it asks the backend. ``take`` is
blocking (it calls the backend); call it through ``asyncio.to_thread``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import Backend, ProcState

_ON_DEVICE = (ProcState.RUNNING, ProcState.LOCKED)
_PARKED = (ProcState.CHECKPOINTED, ProcState.PARTIAL)          # needs a restore before it runs
_IN_FLIGHT = (ProcState.CHECKPOINTED, ProcState.PARTIAL, ProcState.LOCKED, ProcState.FAILED)


def job_state(states: Mapping[int, ProcState]) -> str:
    """The status ``state`` of a job whose processes are in ``states``.

    Any checkpointed (or partly paused) process makes the job snapshotted (it
    cannot run until restored, and a restore of the others is a no-op); a process
    the driver reports FAILED makes it lost; a process whose state cannot be read
    (a cooperative worker with no channel to this agent) makes it unknown, never
    running: it may have released regions a grant would fault on; every process
    on a device locked (and none checkpointed) makes it frozen: in place, running
    nothing (a strict group's elided handoff, an orphan; mid-op, a snapshot's
    lock looks the same).
    """
    live = [s for s in states.values() if s is not ProcState.GONE]
    if not live:
        return R.GONE
    if ProcState.FAILED in live:
        return R.LOST
    if ProcState.UNKNOWN in live:
        return R.UNKNOWN
    if any(s in _PARKED for s in live):
        return R.SNAPSHOTTED
    on = [s for s in live if s in _ON_DEVICE]
    if on and all(s is ProcState.LOCKED for s in on):
        return R.FROZEN
    return R.RUNNING


@dataclass(frozen=True)
class Picture:
    states: dict[int, ProcState] = field(default_factory=dict)
    bytes: dict[int, int] = field(default_factory=dict)   # pid -> on device, or its snapshot size
    # pid -> device id -> bytes: where a process has a context now (0 bytes counts:
    # it is there), or where its snapshot was taken from (and a restore puts it back).
    usage: dict[int, dict[str, int]] = field(default_factory=dict)
    # pid -> device id -> bytes still on a device for a process whose state alone does not say
    # so: what a PARTIAL one kept there, an UNKNOWN one's memory as the device meter sees it.
    left: dict[int, dict[str, int]] = field(default_factory=dict)
    # pid -> device bytes a paused cooperative process still holds outside its regions (its measure)
    residue: dict[int, int] = field(default_factory=dict)

    @property
    def residue_bytes(self) -> int:
        """What the job leaves on the devices while parked (cooperative pause; 0 if unknown)."""
        return sum(n for p, n in self.residue.items() if self.states.get(p) in _PARKED)

    @property
    def resident_bytes(self) -> int:
        """Bytes on the devices now."""
        return sum(self.bytes.get(p, 0) for p, s in self.states.items() if s in _ON_DEVICE) + \
            sum(sum(d.values()) for d in self.left.values())

    @property
    def snapshot_bytes(self) -> int:
        """Bytes in host memory (recorded at checkpoint, or released by a pause)."""
        return sum(self.bytes.get(p, 0) for p, s in self.states.items() if s in _PARKED)

    @property
    def partial(self) -> bool:
        """True if the job is parked with memory left on a device (a further snapshot frees more)."""
        return self.state == R.SNAPSHOTTED and self.resident_bytes > 0

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

    @property
    def resident_devices(self) -> dict[str, int]:
        """Device id -> bytes of the job's processes with a context there now (running or locked).

        A process without a device context (``NO_CUDA``: CPU-only, or registered before CUDA
        initialised) adds nothing: the job is not resident because of it.
        """
        return _sum([*(self.usage.get(p, {}) for p, s in self.states.items() if s in _ON_DEVICE),
                     *self.left.values()])

    @property
    def gpu_bytes(self) -> dict[str, int]:
        """The job's footprint per device for its status: the snapshot's while snapshotted
        (a restore lands each process back on its device), else what is resident."""
        if self.state == R.SNAPSHOTTED:
            return _sum(self.usage.get(p, {}) for p, s in self.states.items() if s in _PARKED)
        return self.resident_devices

    def needs(self, op: str) -> bool:
        """True if ``op`` has something left to do (idempotency: otherwise report done)."""
        live = [s for s in self.states.values() if s is not ProcState.GONE]
        if ProcState.FAILED in live or ProcState.UNKNOWN in live:
            return True            # let the op report the failure with the backend's words
        todo = {R.SNAPSHOT: (*_ON_DEVICE, ProcState.PARTIAL), R.FREEZE: (ProcState.RUNNING,),
                R.THAW: (ProcState.LOCKED,)}.get(op, (*_PARKED, ProcState.LOCKED))
        return any(s in todo for s in live)

    def describe(self) -> dict[str, str]:
        return {str(p): str(s) for p, s in sorted(self.states.items())}


def take(backend: Backend, pids: Iterable[int], remembered: Iterable[int] = (), unknown: Iterable[int] = ()
         ) -> Picture:
    """The picture of a job's processes: ``pids`` (registered now) and ``remembered`` ones.

    ``unknown`` pids are registered ones the agent may not read for the job yet (settling:
    not attested to this agent since it started, ``nodeagent/processes.py``): they count as
    unknown, on the device as the meter sees them, so the job is never taken for absent.

    A remembered pid (from the agent's own last status of the job, whose
    registration may have lapsed with the job's session) counts only while it
    holds something of the job's in flight: checkpointed, locked or failed.
    A remembered pid that runs normally may be a reused pid of another
    process, and must never be acted on.
    """
    states: dict[int, ProcState] = {}
    sizes: dict[int, int] = {}
    usage: dict[int, dict[str, int]] = {}
    left: dict[int, dict[str, int]] = {}
    residue: dict[int, int] = {}
    measure = getattr(backend, "residue_bytes", None)      # cooperative workers only (backends.composite)
    pids, unknown = set(pids), set(unknown)
    for pid in sorted(unknown - pids):
        states[pid] = ProcState.UNKNOWN
        on = {d: n for d, n in (backend.device_usage(pid) or {}).items() if n > 0}
        if on:
            left[pid] = on
    for pid in sorted(pids | set(remembered)):
        if pid in states:
            continue
        s = backend.get_state(pid)
        if pid not in pids and s not in _IN_FLIGHT:
            continue
        states[pid] = s
        if s in (ProcState.PARTIAL, ProcState.UNKNOWN):
            # On the device as the meter sees it: regions a partial pause kept, or a worker whose
            # own word is not in yet (never "no memory": the planner must not count it absent).
            on = {d: n for d, n in (backend.device_usage(pid) or {}).items() if n > 0}
            if on:
                left[pid] = on
        if s in _ON_DEVICE:
            per = backend.device_usage(pid)
        elif s in _PARKED:
            per = backend.snapshot_usage(pid)
            kept = measure(pid) if measure is not None else None
            if kept is not None:
                residue[pid] = kept
        else:
            continue
        usage[pid] = dict(per or {})
        sizes[pid] = sum(usage[pid].values())
    return Picture(states, sizes, usage, left, residue)


def _sum(maps: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for dev, n in m.items():
            out[dev] = out.get(dev, 0) + n
    return dict(sorted(out.items()))
