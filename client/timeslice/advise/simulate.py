"""A simulation of lockd's scheduler for one group: FIFO turns, swap costs, elision; sans-IO.

The prediction ``timeslice advise`` makes, and the figures the demo and the
benchmarks measure, come from here: ``union_length`` is the one definition of
"GPU busy" (the union of the holds), and duty cycle is busy time over wall time.

The model is the scheduler's own rule (lockd/plan.py), played forward with
each job's recorded phases drawn at random (bootstrap) from its profile:

* a job alternates a CPU phase (gap) and a GPU phase (hold); between them it
  queues for the group, FIFO by arrival; of a hold the job computes
  ``busy_share`` (its own measure over the lock's: the rest is round trips
  during which the group is taken but the GPU idle);
* the head's turn: if it is resident, the grant follows at once ("elided"
  when other jobs are resident beside it); else, when it does not fit beside
  the resident jobs, *all* of those are snapshotted (in parallel: the slowest
  sets the time), then it is restored if it was parked; each step costs its
  op time plus ``op_s`` of control plane (intent, report); every grant costs
  ``handoff_s`` (etcd round trips);
* a yield with nobody waiting leaves the job resident (deferred snapshot).

A job's predicted slowdown is its mean step (gap + wait + hold) in the group
over its step alone, less one: alone is the job's own work with no lock at all
(``alone_s``, where the profile says it: what the job would take on a GPU of its
own without timeslice, so the lock's own round trips count as slowdown too),
else its solo step through the lock (gap + hold + one handoff).
"""
from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, field

from timeslice.common.intervals import duty

DEFAULT_HANDOFF_S = 0.005
DEFAULT_OP_S = 0.005


@dataclass(frozen=True)
class SimJob:
    name: str
    hold_s: tuple[float, ...]
    gap_s: tuple[float, ...]
    snapshot_s: float = 0.0
    restore_s: float = 0.0
    nbytes: int = 0                       # its footprint on each GPU of the group
    busy_share: float = 1.0               # of each hold, the share the job computes (the rest: round trips)
    alone_s: float = 0.0                  # its step with no lock at all (its own work); 0: solo_step_s + handoff

    def __post_init__(self) -> None:
        if not self.hold_s or not self.gap_s:
            raise ValueError(f"job {self.name}: needs at least one hold and one gap sample")

    @property
    def solo_step_s(self) -> float:
        return statistics.fmean(self.hold_s) + statistics.fmean(self.gap_s)


@dataclass(frozen=True)
class SimGroup:
    capacity_bytes: int = 0               # per GPU; 0 = unknown: nothing fits beside another job
    handoff_s: float = DEFAULT_HANDOFF_S
    op_s: float = DEFAULT_OP_S
    margin_bytes: int = 0


@dataclass
class SimJobResult:
    name: str
    holds: int = 0
    mean_step_s: float = 0.0
    solo_step_s: float = 0.0
    mean_wait_s: float = 0.0
    slowdown: float = 0.0

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class SimResult:
    duty: float
    window_s: float
    jobs: dict[str, SimJobResult] = field(default_factory=dict)
    swaps: int = 0                        # turns that moved memory
    elided: int = 0                       # turns that moved nothing although another job was resident
    holds: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def max_slowdown(self) -> float:
        return max((j.slowdown for j in self.jobs.values()), default=0.0)


def simulate(jobs: list[SimJob], group: SimGroup, *, horizon_s: float | None = None, cycles: int = 150,
             seed: int = 0) -> SimResult:
    """Play the group forward; every job requests the GPUs at t=0 in list order (arrival order).

    ``horizon_s`` (default: ``cycles`` of the slowest solo step) bounds simulated time; figures
    are taken after the warm-up (once every job has held the group once)."""
    if not jobs:
        return SimResult(0.0, 0.0)
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must be distinct")
    rng = random.Random(seed)
    horizon = horizon_s if horizon_s is not None else cycles * max(j.solo_step_s for j in jobs)
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def at(t: float, kind: str, j: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, j))
        seq += 1

    queue: list[int] = []
    requested = [0.0] * len(jobs)
    resident: set[int] = set()
    parked: set[int] = set()
    busy = False                          # a turn (swap + grant) or a hold is in progress
    holds: list[tuple[float, float, str]] = []
    waits: list[list[tuple[float, float]]] = [[] for _ in jobs]     # (granted at, wait)
    releases: list[list[float]] = [[] for _ in jobs]
    swaps = elided = 0
    for i in range(len(jobs)):
        at(0.0, "request", i)

    def start_turn(t: float) -> None:
        nonlocal busy, swaps, elided
        head = queue[0]
        job = jobs[head]
        others = resident - {head}
        cost = 0.0
        if head not in resident:
            used = sum(jobs[o].nbytes for o in others)
            fits = bool(group.capacity_bytes) and used + job.nbytes + group.margin_bytes <= group.capacity_bytes
            if others and not fits:
                cost += max(jobs[o].snapshot_s for o in others) + group.op_s
                parked.update(others)
                resident.difference_update(others)
            if head in parked:
                cost += job.restore_s + group.op_s
                parked.discard(head)
            resident.add(head)
            if cost > 0:
                swaps += 1
            elif others:
                elided += 1
        elif others:
            elided += 1
        busy = True
        at(t + cost + group.handoff_s, "grant", head)

    while events:
        t, _, kind, i = heapq.heappop(events)
        if t > horizon:
            break
        if kind == "request":
            requested[i] = t
            queue.append(i)
            if not busy:
                start_turn(t)
        elif kind == "grant":
            queue.pop(0)
            waits[i].append((t, t - requested[i]))
            hold = rng.choice(jobs[i].hold_s)
            holds.append((t, t + hold * jobs[i].busy_share, jobs[i].name))
            at(t + hold, "release", i)
        else:                                                     # release
            releases[i].append(t)
            busy = False
            at(t + rng.choice(jobs[i].gap_s), "request", i)
            if queue:
                start_turn(t)

    warm = max((r[0] for r in releases if r), default=0.0)
    end = min(horizon, max((e for _, e, _ in holds), default=0.0))
    res = SimResult(duty([(s, e) for s, e, _ in holds], warm, end), max(0.0, end - warm), swaps=swaps,
                    elided=elided, holds=holds)
    for i, j in enumerate(jobs):
        rel = [r for r in releases[i] if warm <= r <= end]
        steps = [b - a for a, b in itertools.pairwise(rel)]
        solo = j.alone_s or j.solo_step_s + group.handoff_s
        mean_step = statistics.fmean(steps) if steps else float("inf")
        w = [x for g, x in waits[i] if warm <= g <= end]
        res.jobs[j.name] = SimJobResult(j.name, len(rel), mean_step, solo, statistics.fmean(w) if w else 0.0,
                                     mean_step / solo - 1 if solo > 0 else 0.0)
    return res
