"""Where jobs sit on a node's GPUs, sans-IO: the per-GPU view the planner decides on.

A group names GPUs per node (``GroupSpec.nodes[].gpus``; empty = every GPU of
the node). Deciding fit, elision and eviction from node totals is wrong on a
multi-GPU node: one GPU full and three empty has plenty of free memory in sum
and none where the job on the full GPU goes, so the agent — which admits a
restore GPU by GPU — refuses what the plan promised. This module answers, per
GPU index, from what etcd holds:

* where a job has a device context: what the agent saw (``AgentValue.job_gpus``,
  device ids mapped to indexes by ``AgentValue.gpus``), completed by what the
  job's workers declared (``WorkerValue.gpus``); a job the agent looked at and
  found without any device context (a CPU-only pid, a worker registered before
  CUDA init) is on no GPU and never blocks anyone; a job the agent has not
  looked at yet is where its workers say, else on every GPU (not knowing is
  not room);
  a job whose state the agent cannot read now (``AgentValue.job_unknown``) is
  placed the same way when the agent's meter could not place it;
* how much a snapshotted job needs back, per GPU (``StatusValue.gpu_bytes``,
  recorded at checkpoint: a restore lands each process on its own GPU);
* free bytes per GPU, less what residents registered beyond what the agent
  counted (its report can be a refresh old).

The device-bytes hint of an Acquire is per node (lockd.proto); it is spread
evenly over the GPUs the job uses there.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.lockd.index import JobState


@dataclass
class NodeView:
    node: str
    agent: R.AgentValue | None
    all_gpus: frozenset[int] = frozenset()
    free: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)               # capacity per GPU, where the agent says
    _index: dict[str, int] = field(default_factory=dict)
    _regs: dict[int, list[R.WorkerValue]] = field(default_factory=dict)   # id(JobState) -> its workers here

    @classmethod
    def of(cls, node: str, agent: R.AgentValue | None) -> NodeView:
        v = cls(node, agent)
        for g in (agent.gpus if agent else ()):
            try:
                idx = int(g["index"])
            except (KeyError, TypeError, ValueError):
                continue
            v._index[str(g.get("uuid", idx))] = idx
            v.free[idx] = int(g.get("free_bytes", 0))
            v.total[idx] = int(g.get("total_bytes", 0) or 0)
        if agent is not None and not v.free:
            # An agent that lists no GPU: its node total stands for one device.
            v.free[0] = agent.device_free_bytes
            v.total[0] = agent.device_total_bytes
        v.all_gpus = frozenset(v.free)
        return v

    # --- where things are ----------------------------------------------------------
    def by_index(self, per_device: dict) -> dict[int, int] | None:
        """{device id: bytes} → {GPU index: bytes}; None if an id is unknown (then: everywhere)."""
        out: dict[int, int] = {}
        for dev, n in per_device.items():
            idx = self._index.get(str(dev))
            if idx is None:
                return None
            out[idx] = out.get(idx, 0) + int(n)
        return out

    def group_gpus(self, spec_entry: dict | None) -> frozenset[int]:
        """The group's GPUs on this node (spec's list; empty = all the agent reports)."""
        named = frozenset(int(g) for g in (spec_entry or {}).get("gpus") or ())
        return named or self.all_gpus

    def workers(self, js: JobState | None) -> list[R.WorkerValue]:
        """The job's registrations on this node, parsed once per plan."""
        if js is None:
            return []
        got = self._regs.get(id(js))
        if got is None:
            got = self._regs[id(js)] = [R.WorkerValue.load(kv.value) for (n, _), kv in js.workers.items()
                                        if n == self.node]
        return got

    def declared(self, js: JobState | None) -> tuple[frozenset[int], bool]:
        """(GPUs the job's workers here declared, whether every worker declared some)."""
        found: set[int] = set()
        every = True
        for w in self.workers(js):
            every &= bool(w.gpus)
            found.update(int(g) for g in w.gpus)
        return frozenset(found), every and bool(found)

    def seen(self, job: str) -> dict[int, int] | None:
        """Per-GPU bytes where the agent saw the running job's contexts ({}: none at all);
        None if the agent has not looked at the job (or named a device it did not list)."""
        if self.agent is None or job not in self.agent.job_gpus:
            return None
        return self.by_index(self.agent.job_gpus[job] or {})

    def resident_gpus(self, job: str, js: JobState | None) -> frozenset[int]:
        """GPUs a job that is running here occupies (empty: no device context, not resident)."""
        declared, every = self.declared(js)
        seen = self.seen(job)
        if seen is not None:
            return frozenset(seen) | declared if seen else frozenset()
        if self.agent is not None and job in self.agent.job_gpus:
            return self.all_gpus                       # a device the agent did not list: assume all
        return declared if every else self.all_gpus

    def known_gpus(self, job: str, js: JobState | None, snapshot: R.StatusValue | None) -> frozenset[int]:
        """GPUs a job uses here, known by any means (empty: not known)."""
        declared, _ = self.declared(js)
        seen = self.seen(job) or {}
        snap = self.by_index(snapshot.gpu_bytes) if snapshot is not None and snapshot.gpu_bytes else None
        return declared | frozenset(seen) | frozenset(snap or {})

    # --- free memory -------------------------------------------------------------------
    def free_after_registered(self, residents: dict[str, frozenset[int]], jobs: dict[str, JobState],
                              off_device: dict[str, int] | None = None) -> dict[int, int]:
        """Free bytes per GPU less what residents registered beyond what the agent counted
        (on the device, plus ``off_device``: what a partial pause released), spread over each
        resident's GPUs. A resident the agent cannot see (unknown) counts its whole registration."""
        free = dict(self.free)
        counted = self.agent.job_device_bytes if self.agent else {}
        off = off_device or {}
        for j, gpus in residents.items():
            registered = sum(w.device_bytes for w in self.workers(jobs.get(j)))
            extra = max(0, registered - counted.get(j, 0) - off.get(j, 0))
            if extra and gpus:
                share = -(-extra // len(gpus))
                for g in gpus:
                    free[g] = free.get(g, 0) - share
        return free


spread = FP.spread


def overlaps(spec: R.GroupSpec, node: str, gpus: frozenset[int], view: NodeView) -> bool:
    """True if ``spec`` names ``node`` with a GPU in ``gpus`` (an entry without GPUs: all)."""
    for entry in spec.nodes:
        if entry.get("node") == node and (not entry.get("gpus") or view.group_gpus(entry) & gpus):
            return True
    return False


def need_per_gpu(view: NodeView, job: str, where: str, snap: R.StatusValue | None, gpus: frozenset[int],
                 hint: int, peak: int = 0, context: int = 0,
                 policy: FP.FootprintPolicy = FP.DEFAULT_POLICY) -> dict[int, int] | None:
    """Bytes the head needs made free per GPU here: its admitted footprint (``lockd.footprints``:
    max(declared, observed, seen) + context + margin, + the first hold's spare) less what it holds
    on the device already; None when unknown (never ran, nothing declared or measured).

    ``hint``, ``peak``, ``context``: the queue entry's per-node figures (declared, the largest
    allocator peak it reported, its memory outside the allocator)."""
    def fp(seen: dict[int, int], residue: dict[int, int] | None = None) -> FP.Footprint:
        return FP.footprint(gpus | frozenset(seen), hint=hint, peak=peak, context=context, seen=seen,
                            residue=residue, capacity=view.total)
    if where == "snapshotted":
        # The restore needs its snapshot back on each process's own GPU; the phase then its footprint,
        # less what its cooperative pause left on the device (its residue is there already).
        assert snap is not None     # residency() says "snapshotted" only from a status
        per = view.by_index(snap.gpu_bytes) if snap.gpu_bytes else None
        if per is None:      # no per-GPU record (an older agent): it must fit on every GPU it may use
            per = {g: snap.device_bytes for g in gpus}
        left = spread(snap.residue_bytes, frozenset(per) or gpus)
        f = fp({g: per.get(g, 0) + left.get(g, 0) for g in set(per) | set(left)}, left)   # all it held
        return {g: max(per.get(g, 0), FP.admitted(f, g, policy) - left.get(g, 0) if f.known(g) else 0)
                for g in set(per) | gpus}
    if where == "running":
        if hint <= 0 and peak <= 0:
            return {}                  # nothing declared or measured: it has what it has
        have = view.seen(job) or {}
        f = fp(have)
        return {g: max(0, FP.admitted(f, g, policy) - have.get(g, 0)) for g in gpus | frozenset(have)
                if f.known(g)}
    if hint <= 0 and peak <= 0:
        return None
    f = fp({})
    return {g: FP.admitted(f, g, policy) for g in gpus if f.known(g)} or None


def is_protected(job: str, node: str, gpus: frozenset[int], view: NodeView,
               holding: Callable[[str], Iterable[R.GroupSpec]] | None) -> bool:
    """True if ``job`` holds a group whose devices on ``node`` it occupies (a snapshot would
    park the holder, all its processes on the node at once, while it runs)."""
    return holding is not None and any(overlaps(spec, node, gpus, view) for spec in holding(job))
