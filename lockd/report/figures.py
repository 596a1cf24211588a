"""Figures of one demo run, from the jobs' event files: duty cycle, swaps, overlaps.

* wall: from the moment the jobs were let go to the end of the last phase;
* GPU busy: the union of all GPU phases (the time some job computed on the device);
* duty cycle: GPU busy / wall;
* swaps: grants whose Acquire moved bytes (``bytes_moved > 0``: a resident job
  was snapshotted and/or this job restored); restores: grants with
  ``restored``; elided: grants with ``elided`` (the other job stayed resident
  beside this one, nothing moved); bytes moved: the sum over all grants;
* overlaps: pairs of GPU phases of *different* jobs that overlap in time.
  With time-slicing this must be 0: each GPU phase runs inside a hold.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

# GPU busy time is the union of the holds: one definition (common/intervals.py), which the
# advisor's predictions (`timeslice advise`) use too.
from timeslice.common.intervals import union_length

__all__ = ["RunFigures", "figures", "gpu_phases", "overlapping_pairs", "read_events", "union_length"]


@dataclass
class RunFigures:
    key: str
    title: str
    mode: str
    job_bytes: int
    t0: float = 0.0
    wall_s: float = 0.0
    gpu_busy_s: float = 0.0
    duty: float = 0.0
    grants: int = 0
    handoffs: int = 0
    swaps: int = 0
    restores: int = 0
    elided: int = 0
    bytes_moved: int = 0
    overlaps: int = 0
    tokens_increasing: bool = True
    verifies: int = 0
    bad_verifies: int = 0
    jobs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def read_events(path: str | Path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def gpu_phases(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("type") == "phase" and e.get("gpu")]


def overlapping_pairs(phases: list[dict]) -> list[tuple[dict, dict]]:
    """GPU phases of different jobs whose [t_start, t_end] intervals intersect."""
    ordered = sorted(phases, key=lambda e: e["t_start"])
    bad = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b["t_start"] >= a["t_end"]:
                break
            if b["job"] != a["job"]:
                bad.append((a, b))
    return bad


def figures(key: str, title: str, mode: str, job_bytes: int, events_by_job: dict[str, list[dict]],
            t0: float) -> RunFigures:
    f = RunFigures(key, title, mode, job_bytes, t0=t0, jobs=sorted(events_by_job))
    allev = [e for evs in events_by_job.values() for e in evs]
    phases = [e for e in allev if e.get("type") == "phase"]
    gpu = gpu_phases(allev)
    if not phases:
        return f
    t_end = max(e["t_end"] for e in phases)
    f.wall_s = t_end - t0
    f.gpu_busy_s = union_length([(e["t_start"], e["t_end"]) for e in gpu])
    f.duty = f.gpu_busy_s / f.wall_s if f.wall_s > 0 else 0.0
    granted = sorted((e for e in gpu if "token" in e), key=lambda e: e["t_start"])
    f.grants = len(granted)
    f.swaps = sum(1 for e in granted if e.get("bytes_moved", 0) > 0)
    f.restores = sum(1 for e in granted if e.get("restored"))
    f.elided = sum(1 for e in granted if e.get("elided"))
    f.bytes_moved = sum(int(e.get("bytes_moved", 0)) for e in granted)
    f.handoffs = sum(1 for a, b in pairwise(granted) if a["job"] != b["job"])
    tokens = [e["token"] for e in granted]
    f.tokens_increasing = all(x < y for x, y in pairwise(tokens))
    f.overlaps = len(overlapping_pairs(gpu))
    for e in allev:
        if e.get("type") == "end":
            f.verifies += int(e.get("verifies", 0))
            f.bad_verifies += int(e.get("bad_verifies", 0)) + (0 if e.get("final_verify", True) else 1)
    return f
