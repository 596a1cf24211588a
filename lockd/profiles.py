"""Job profiles from the lock's own history: hold, gap and wait times, footprints, swap costs; sans-IO.

The leader sees every phase of every job: an Acquire creates the job's queue
entry, the grant names it, its Yield (or its session's end) deletes the entry.
So, per (group, job):

* **wait**: entry created (``QueueValue.enqueued_ms``) to grant (``GrantValue.granted_ms``),
  queueing and swaps included;
* **hold**: grant to the entry's deletion — the job's GPU phase;
* **gap**: that deletion to the job's next entry in the group — its CPU phase.
  An Acquire given up before its grant (timeout, cancel) ends no hold and
  measures no gap (the next gap would include the abandoned wait).

The agents add what a swap cost (each answered intent's ``elapsed_ms`` and
bytes, by op) and where the job's memory is (``AgentValue.job_gpus``: bytes per
device; the peak is kept). Every list is bounded (the last ``phases``
samples) and so is the number of profiles (``max_profiles``; the least
recently updated goes first), so what the leader keeps in etcd is bounded.

``ProfileBook`` only interprets; ``profile_recorder.py`` feeds it from the
watch stream and writes the dirty profiles to etcd.
"""
from __future__ import annotations

from dataclasses import dataclass

from timeslice.common import records as R

DEFAULT_PHASES = 64          # samples kept per distribution
DEFAULT_MAX_PROFILES = 1024  # (group, job) profiles kept in all


@dataclass
class _Open:
    """A queue entry seen and not yet deleted."""

    token: int
    enqueued_ms: int
    granted_ms: int = 0


def _push(xs: list[int], v: float, n: int) -> None:
    xs.append(max(0, round(v)))
    del xs[:-n]


def fractions(p: R.ProfileValue) -> tuple[float, float]:
    """(busy, wait) fraction of the job's recent cycle: hold / (hold + gap + wait), wait / (same)."""
    hold, gap, wait = (sum(xs) / len(xs) if xs else 0.0 for xs in (p.hold_ms, p.gap_ms, p.wait_ms))
    cycle = hold + gap + wait
    return (hold / cycle, wait / cycle) if cycle > 0 else (0.0, 0.0)


class ProfileBook:
    def __init__(self, phases: int = DEFAULT_PHASES, max_profiles: int = DEFAULT_MAX_PROFILES):
        if phases < 1 or max_profiles < 1:
            raise ValueError("phases and max_profiles must be >= 1")
        self.phases, self.max_profiles = phases, max_profiles
        self.profiles: dict[tuple[str, str], R.ProfileValue] = {}
        self._open: dict[tuple[str, str], _Open] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._evicted: set[tuple[str, str]] = set()

    # -- state ------------------------------------------------------------------------
    def load(self, values: list[R.ProfileValue]) -> None:
        """Start from what etcd holds (a new leader): the stored profiles, nothing open."""
        self.profiles = {(v.group, v.job): v for v in values}
        self._open.clear()
        self._dirty.clear()
        self._evicted.clear()
        self._bound(0)

    def reopen(self, group: str, job: str, token: int, enqueued_ms: int, granted_ms: int) -> None:
        """An entry that exists now (found at start or after a resync): track it from here."""
        self._open[(group, job)] = _Open(token, enqueued_ms, granted_ms)

    def _get(self, group: str, job: str, now_ms: int) -> R.ProfileValue:
        key = (group, job)
        p = self.profiles.get(key)
        if p is None:
            p = self.profiles[key] = R.ProfileValue(job=job, group=group, first_ms=now_ms, updated_ms=now_ms)
            self._evicted.discard(key)
            self._bound(now_ms)
        p.updated_ms = max(p.updated_ms, now_ms)
        self._dirty.add(key)
        return p

    def _bound(self, now_ms: int) -> None:
        while len(self.profiles) > self.max_profiles:
            key = min(self.profiles, key=lambda k: self.profiles[k].updated_ms)
            del self.profiles[key]
            self._dirty.discard(key)
            self._evicted.add(key)

    # -- the lock's events ----------------------------------------------------------------
    def enqueued(self, group: str, job: str, token: int, enqueued_ms: int, hint_bytes: int = 0,
                 last_hold_ms: int = 0) -> None:
        """The job's queue entry was created (an Acquire arrived); ``last_hold_ms``: the job's own
        measure of its previous hold, its GPU phase without the lock's round trips."""
        key = (group, job)
        o = self._open.get(key)
        if o is not None and o.token == token:
            return                                   # a re-sent Acquire rewrote the same entry
        self._open[key] = _Open(token, enqueued_ms)
        p = self._get(group, job, enqueued_ms)
        if p.last_release_ms and enqueued_ms >= p.last_release_ms:
            _push(p.gap_ms, enqueued_ms - p.last_release_ms, self.phases)
            if 0 < last_hold_ms <= (p.hold_ms[-1] if p.hold_ms else 0):
                _push(p.busy_ms, last_hold_ms, self.phases)
        p.last_release_ms = 0
        p.device_bytes = max(p.device_bytes, hint_bytes)

    def granted(self, group: str, job: str, token: int, granted_ms: int, restored: bool, elided: bool) -> None:
        o = self._open.get((group, job))
        if o is None or o.token != token or o.granted_ms:
            return                                   # unknown entry, or this grant was counted
        o.granted_ms = granted_ms
        p = self._get(group, job, granted_ms)
        _push(p.wait_ms, granted_ms - o.enqueued_ms, self.phases)
        p.grants += 1
        p.restored += int(restored)
        p.elided += int(elided)

    def left(self, group: str, job: str, token: int | None, now_ms: int) -> None:
        """The job's queue entry was deleted: a yield (or its session ended) if it was granted.

        ``token``: the entry's, when known (a watch's delete event does not carry it)."""
        o = self._open.get((group, job))
        if o is None or (token is not None and o.token != token):
            return
        del self._open[(group, job)]
        p = self._get(group, job, now_ms)
        if o.granted_ms:
            _push(p.hold_ms, now_ms - o.granted_ms, self.phases)
            p.last_release_ms = now_ms
        else:
            p.last_release_ms = 0                    # an abandoned wait: no gap to measure

    def swapped(self, group: str, job: str, op: str, elapsed_ms: float, nbytes: int, device_bytes: int,
                now_ms: int) -> None:
        """An agent answered a swap intent for the job (one per node)."""
        if op not in (R.SNAPSHOT, R.RESTORE) or not group:
            return
        p = self._get(group, job, now_ms)
        _push(p.snapshot_ms if op == R.SNAPSHOT else p.restore_ms, elapsed_ms, self.phases)
        _push(p.swap_bytes, nbytes, self.phases)
        if op == R.SNAPSHOT:
            p.host_bytes = max(p.host_bytes, nbytes)
        p.device_bytes = max(p.device_bytes, device_bytes)

    def footprint(self, groups: list[str], job: str, node: str, per_device: dict, now_ms: int) -> None:
        """An agent reported the job's bytes per device on ``node`` (``groups``: those on the node)."""
        total = sum(int(b) for b in per_device.values() if isinstance(b, int | float))
        for g in groups:
            p = self.profiles.get((g, job))
            if p is None:
                continue                             # the job never queued in this group
            changed = False
            for dev, b in per_device.items():
                k = f"{node}/{dev}"
                if isinstance(b, int | float) and int(b) > p.gpu_bytes.get(k, 0):
                    p.gpu_bytes[k] = int(b)
                    changed = True
            if total > p.device_bytes:
                p.device_bytes, changed = total, True
            if changed:
                self._get(g, job, now_ms)

    # -- for the writer ----------------------------------------------------------------------
    def take_dirty(self) -> tuple[list[R.ProfileValue], list[tuple[str, str]]]:
        """(profiles changed since the last take, (group, job) evicted since); both cleared."""
        dirty = [self.profiles[k] for k in sorted(self._dirty) if k in self.profiles]
        gone = sorted(self._evicted)
        self._dirty.clear()
        self._evicted.clear()
        return dirty, gone

    def put_back(self, dirty: list[R.ProfileValue], gone: list[tuple[str, str]]) -> None:
        """A write failed: mark them again for the next attempt."""
        self._dirty.update((p.group, p.job) for p in dirty if (p.group, p.job) in self.profiles)
        self._evicted.update(k for k in gone if k not in self.profiles)
