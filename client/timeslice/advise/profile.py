"""Job profiles as ``timeslice profile`` shows them and ``timeslice advise`` reads them; sans-IO.

A ``ProfileSet`` is what lockd's GetProfiles answers (the leader's record of
each job's phases per group, the groups, the nodes' capacities) and also the
file ``timeslice profile --json`` writes and ``timeslice advise --from FILE``
reads, so profiles taken on one cluster can be planned with on another:

    {"version": 1, "profiles": [{"job": ..., "group": ..., "hold_ms": [...], ...}],
     "groups": [{"group": ..., "nodes": [{"node": ..., "gpus": [...]}]}],
     "nodes": [{"node": ..., "host_free_bytes": ..., "gpus": [{"id", "index", "total_bytes"}]}]}
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from timeslice.common.profile import SAMPLE_LISTS, ProfileFigures

FORMAT_VERSION = 1
LISTS = SAMPLE_LISTS
MAX_SAMPLES = 4096          # per list read from a file (lockd keeps far fewer)


class ProfileFormatError(ValueError):
    """A profile file that is not what ``timeslice profile --json`` writes."""


def mean(xs: list[int] | list[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def pct(xs: list[int] | list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q * len(s)))])


@dataclass
class JobProfile(ProfileFigures):
    live: bool = False                                      # the job has a session now

    # -- figures ----------------------------------------------------------------------
    @property
    def solo_step_ms(self) -> float:
        """Its step alone on its GPUs: a GPU phase and a CPU phase, nothing to wait for."""
        return mean(self.hold_ms) + mean(self.gap_ms)

    @property
    def busy_fraction(self) -> float:
        """Share of its cycle (as measured, waits included) that it held the GPUs."""
        cyc = mean(self.hold_ms) + mean(self.gap_ms) + mean(self.wait_ms)
        return mean(self.hold_ms) / cyc if cyc > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        cyc = mean(self.hold_ms) + mean(self.gap_ms) + mean(self.wait_ms)
        return mean(self.wait_ms) / cyc if cyc > 0 else 0.0

    @property
    def demand(self) -> float:
        """Share of its solo step it needs the GPUs: hold / (hold + gap). Pairs pay when these sum below 1."""
        s = self.solo_step_ms
        return mean(self.hold_ms) / s if s > 0 else 0.0

    @property
    def busy_share(self) -> float:
        """Of a hold as lockd saw it, the share the job itself computed (the rest: the lock's round trips)."""
        h = mean(self.hold_ms)
        return min(1.0, mean(self.busy_ms) / h) if self.busy_ms and h > 0 else 1.0

    @property
    def per_gpu_bytes(self) -> int:
        """Its largest footprint on one device (the device report, else the node's total)."""
        return max(self.gpu_bytes.values(), default=0) or self.device_bytes

    @property
    def gpu_count(self) -> int:
        return sum(1 for b in self.gpu_bytes.values() if b > 0) or 1

    def usable(self) -> bool:
        """Enough phases to plan with: a hold and a gap at least."""
        return bool(self.hold_ms and self.gap_ms)

    # -- conversions ------------------------------------------------------------------
    @classmethod
    def from_pb(cls, p) -> JobProfile:
        return cls(job=p.job_id, group=p.group_id, hold_ms=list(p.hold_ms), gap_ms=list(p.gap_ms),
                   wait_ms=list(p.wait_ms), snapshot_ms=list(p.snapshot_ms), restore_ms=list(p.restore_ms),
                   swap_bytes=list(p.swap_bytes), busy_ms=list(p.busy_ms), gpu_bytes=dict(p.gpu_bytes), device_bytes=p.device_bytes,
                   host_bytes=p.host_bytes, grants=p.grants, elided=p.elided, restored=p.restored,
                   updated_ms=p.updated_unix_ms, live=p.live, peak_bytes=p.peak_bytes,
                   context_bytes=p.context_bytes, residue_bytes=p.residue_bytes)

    @classmethod
    def from_dict(cls, d: dict) -> JobProfile:
        if not isinstance(d, dict) or not isinstance(d.get("job"), str) or not isinstance(d.get("group"), str):
            raise ProfileFormatError("each profile needs a job and a group (strings)")
        kw: dict[str, Any] = {"job": d["job"], "group": d["group"]}
        for name in LISTS:
            xs = d.get(name, [])
            if not isinstance(xs, list) or not all(isinstance(x, int | float) and x >= 0 for x in xs):
                raise ProfileFormatError(f"{d['job']}: {name} must be a list of non-negative numbers")
            kw[name] = [int(x) for x in xs[-MAX_SAMPLES:]]
        gb = d.get("gpu_bytes", {})
        if not isinstance(gb, dict) or not all(isinstance(v, int | float) for v in gb.values()):
            raise ProfileFormatError(f"{d['job']}: gpu_bytes must map device to bytes")
        kw["gpu_bytes"] = {str(k): int(v) for k, v in gb.items()}
        for name in ("device_bytes", "host_bytes", "grants", "elided", "restored", "updated_ms",
                     "peak_bytes", "context_bytes", "residue_bytes"):
            v = d.get(name, 0)
            if not isinstance(v, int | float) or v < 0:
                raise ProfileFormatError(f"{d['job']}: {name} must be a non-negative number")
            kw[name] = int(v)
        kw["live"] = bool(d.get("live", False))
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(busy_fraction=round(self.busy_fraction, 4), wait_fraction=round(self.wait_fraction, 4),
                 demand=round(self.demand, 4))
        return d


@dataclass
class GpuSet:
    """A group's devices: [(node, [gpu indices])] (no indices: all the node's)."""

    group: str
    nodes: list[tuple[str, list[int]]]

    def to_dict(self) -> dict:
        return {"group": self.group, "nodes": [{"node": n, "gpus": list(g)} for n, g in self.nodes]}


@dataclass
class NodeInfo:
    node: str
    host_free_bytes: int = 0
    gpus: list[dict] = field(default_factory=list)     # [{"id", "index", "total_bytes"}]

    def gpu_total(self, index: int | None = None) -> int:
        sizes = [int(g.get("total_bytes", 0)) for g in self.gpus if index is None or g.get("index") == index]
        return min(sizes, default=0)


@dataclass
class ProfileSet:
    profiles: list[JobProfile] = field(default_factory=list)
    groups: list[GpuSet] = field(default_factory=list)
    nodes: list[NodeInfo] = field(default_factory=list)

    @classmethod
    def from_pb(cls, r) -> ProfileSet:
        return cls([JobProfile.from_pb(p) for p in r.profiles],
                   [GpuSet(g.group_id, [(n.node, list(n.gpus)) for n in g.nodes]) for g in r.groups],
                   [NodeInfo(n.node, n.host_free_bytes,
                             [{"id": g.id, "index": g.index, "total_bytes": g.total_bytes} for g in n.gpus])
                    for n in r.nodes])

    @classmethod
    def from_dict(cls, d: Any) -> ProfileSet:
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION or not isinstance(d.get("profiles"), list):
            raise ProfileFormatError(f"not a profile file (version {FORMAT_VERSION}, from `timeslice profile --json`)")
        try:
            groups = [GpuSet(str(g["group"]), [(str(n["node"]), [int(i) for i in n.get("gpus", [])])
                                              for n in g.get("nodes", [])]) for g in d.get("groups", [])]
            nodes = [NodeInfo(str(n["node"]), int(n.get("host_free_bytes", 0)), list(n.get("gpus", [])))
                     for n in d.get("nodes", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileFormatError(f"groups / nodes malformed: {e}") from None
        return cls([JobProfile.from_dict(p) for p in d["profiles"]], groups, nodes)

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "profiles": [p.to_dict() for p in self.profiles],
                "groups": [g.to_dict() for g in self.groups], "nodes": [asdict(n) for n in self.nodes]}

    def node(self, name: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node == name), None)
