"""Job profiles from the lock's own history (hold, gap and wait times, footprints, swap costs), and GetProfiles.

The leader already keeps a bounded record of every finished hold in etcd
(lockd/history.py, ``history/<group>/<token>``: the grant, the queue entry's
enqueue time, the release, and the agents' answers to that grant's swap
intents). A profile is read off those records, per (group, job), so it lives
where a new leader finds it and costs no write of its own:

* **hold**: grant to release, as the leader saw them;
* **busy**: the same hold as the job measured it (its Acquire returning to its
  Yield call; the job sends it with its next Acquire, ``last_hold_ms``, and the
  next record carries it): the GPU phase without the lock's round trips;
* **wait**: enqueue to grant (queueing and swaps);
* **gap**: release to the job's next enqueue in the group (its CPU phase);
* **snapshot** / **restore**: the agents' answers naming the job (a snapshot is
  answered under the grant of the job that needed the room);
* **footprint**: the largest bytes per ``<node>/<device>`` seen at a release
  (the agents' reports then), in those answers and in the agents' live reports
  (``AgentValue.job_gpus``); the queue hint else;
* **measured memory** (lockd/footprints.py): the largest allocator peak and
  context the job reported with its Acquires (``peak_bytes``, ``context_bytes``:
  the record of a hold carries what its Acquire said of the earlier ones), and
  the largest residue a cooperative pause of it left (the agents' answers).

Only the newest ``phases`` samples of each list are kept. ``build`` and ``fractions``
are sans-IO. ``ProfileService`` answers GetProfiles (what ``timeslice profile`` shows and
``timeslice advise`` plans with: the profiles, the groups, the nodes' capacities) from
this replica's mirror, so any replica answers and a reader never waits for an election;
built once per mirror revision, a scrape or a second call at the same revision costs
nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from timeslice.common.ids import check_id
from timeslice.common.profile import SAMPLE_LISTS, ProfileFigures
from timeslice.common.server import records as R
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.lockd.groups import Groups
from timeslice.lockd.index import StateIndex
from timeslice.proto import lockd_pb2 as pb

DEFAULT_PHASES = 64


@dataclass
class Profile(ProfileFigures):
    first_ms: int = 0                                      # the first hold's grant

    def trim(self, n: int) -> Profile:
        for name in SAMPLE_LISTS:
            del getattr(self, name)[:-n]
        return self


def fractions(p: Profile) -> tuple[float, float]:
    """(busy, wait) share of the job's recent cycle: hold / (hold + gap + wait), wait / (same)."""
    hold, gap, wait = (sum(xs) / len(xs) if xs else 0.0 for xs in (p.hold_ms, p.gap_ms, p.wait_ms))
    cycle = hold + gap + wait
    return (hold / cycle, wait / cycle) if cycle > 0 else (0.0, 0.0)


def _ms(v: float) -> int:
    return max(0, round(v))


def build(records: Iterable[R.HoldRecord], agents: Mapping[str, R.AgentValue] | None = None,
          nodes_of: Mapping[str, list[str]] | None = None, phases: int = DEFAULT_PHASES) -> list[Profile]:
    """The profiles of every (group, job) in ``records``; ``agents``: node -> its live report,
    ``nodes_of``: group -> its nodes (live footprints are read from those agents)."""
    by: dict[tuple[str, str], list[R.HoldRecord]] = {}
    for rec in records:
        by.setdefault((rec.group, rec.job), []).append(rec)
    out: dict[tuple[str, str], Profile] = {}
    for (group, job), recs in by.items():
        recs.sort(key=lambda r: r.token)
        p = out[(group, job)] = Profile(job, group, first_ms=recs[0].granted_ms, updated_ms=recs[-1].released_ms)
        prev: R.HoldRecord | None = None
        for r in recs:
            hold = r.released_ms - r.granted_ms
            p.hold_ms.append(_ms(hold))
            if r.enqueued_ms:
                p.wait_ms.append(_ms(r.granted_ms - r.enqueued_ms))
            if prev is not None and r.enqueued_ms >= prev.released_ms:
                p.gap_ms.append(_ms(r.enqueued_ms - prev.released_ms))
                if 0 < r.prev_busy_ms <= prev.released_ms - prev.granted_ms:
                    p.busy_ms.append(r.prev_busy_ms)      # the job's own measure of that previous hold
            p.grants += 1
            p.elided += int(r.elided)
            p.restored += int(r.restored)
            p.device_bytes = max(p.device_bytes, r.hint_bytes)
            p.peak_bytes = max(p.peak_bytes, r.peak_bytes)
            p.context_bytes = max(p.context_bytes, r.context_bytes)
            per_node: dict[str, dict] = {}
            for k, b in r.gpu_bytes.items():
                node, _, dev = str(k).partition("/")
                per_node.setdefault(node, {})[dev] = b
            for node, per_dev in per_node.items():
                _peaks(p, node, per_dev)
            prev = r
    for rec in sorted((r for rs in by.values() for r in rs), key=lambda r: r.token):
        for a in rec.swaps:
            moved = out.get((rec.group, str(a.get("job", ""))))
            op = a.get("op")
            if moved is None or op not in (R.SNAPSHOT, R.RESTORE):
                continue                                  # a job of another group made room here
            (moved.snapshot_ms if op == R.SNAPSHOT else moved.restore_ms).append(_ms(float(a.get("elapsed_ms", 0))))
            nbytes = int(a.get("bytes", 0))
            moved.swap_bytes.append(nbytes)
            if op == R.SNAPSHOT:
                moved.host_bytes = max(moved.host_bytes, nbytes)
                moved.residue_bytes = max(moved.residue_bytes, int(a.get("residue_bytes") or 0))
            _peaks(moved, str(a.get("node", "")), a.get("gpu_bytes") or {})
    for (group, job), prof in out.items():
        for node in (nodes_of or {}).get(group, []):
            av = (agents or {}).get(node)
            live = av.job_gpus.get(job) if av is not None and isinstance(av.job_gpus, dict) else None
            if isinstance(live, dict):
                _peaks(prof, node, live)
        prof.trim(phases)
    return [out[k] for k in sorted(out)]


def _peaks(p: Profile, node: str, per_dev: Mapping) -> None:
    total = 0
    for dev, b in list(per_dev.items())[:64]:
        if isinstance(b, int | float) and b > 0:
            k = f"{node}/{dev}"
            p.gpu_bytes[k] = max(p.gpu_bytes.get(k, 0), int(b))
            total += int(b)
    p.device_bytes = max(p.device_bytes, total)


class ProfileService:
    def __init__(self, keys: Keys, index: StateIndex, reflector: Reflector, groups: Groups,
                 phases: int = DEFAULT_PHASES):
        self.keys, self.index, self.reflector, self.groups, self.phases = keys, index, reflector, groups, phases
        self._cache: tuple[int, list[Profile]] = (-1, [])

    def profiles(self) -> list[Profile]:
        rev = self.reflector.revision
        if self._cache[0] != rev:
            records = []
            for _, kv in self.reflector.items(self.keys.history()):
                try:
                    records.append(R.HoldRecord.load(kv.value))
                except (ValueError, TypeError):
                    continue                          # a record a newer writer spelled differently
            agents = {n: a for n, ns in self.index.nodes.items() if (a := _agent(ns.agent)) is not None}
            nodes_of = {g: gs.parsed.node_names() for g, gs in self.index.groups.items() if gs.parsed is not None}
            self._cache = (rev, build(records, agents, nodes_of, self.phases))
        return self._cache[1]

    def _live(self, job: str) -> bool:
        js = self.index.jobs.get(job)
        return js is not None and js.session is not None

    def fractions(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(group, job) -> (busy, wait) share of the live jobs' recent cycles."""
        return {(p.group, p.job): fractions(p) for p in self.profiles() if self._live(p.job)}

    def get(self, job: str = "", group: str = "") -> pb.ProfilesReply:
        if job:
            check_id("job", job)
        if group:
            check_id("group", group)
        out = pb.ProfilesReply()
        for p in self.profiles():
            if (job and p.job != job) or (group and p.group != group):
                continue
            out.profiles.append(pb.Profile(
                job_id=p.job, group_id=p.group, hold_ms=p.hold_ms, gap_ms=p.gap_ms, wait_ms=p.wait_ms,
                snapshot_ms=p.snapshot_ms, restore_ms=p.restore_ms, swap_bytes=p.swap_bytes, busy_ms=p.busy_ms,
                gpu_bytes=p.gpu_bytes, device_bytes=p.device_bytes, host_bytes=p.host_bytes, grants=p.grants,
                elided=p.elided, restored=p.restored, first_unix_ms=p.first_ms, updated_unix_ms=p.updated_ms,
                live=self._live(p.job), peak_bytes=p.peak_bytes, context_bytes=p.context_bytes,
                residue_bytes=p.residue_bytes))
        out.groups.extend(self.groups.list())
        for node, ns in sorted(self.index.nodes.items()):
            a = _agent(ns.agent)
            if a is None:
                continue
            out.nodes.append(pb.NodeCapacity(node=node, host_free_bytes=a.host_free_bytes, gpus=[
                pb.DeviceCapacity(id=str(g.get("uuid", "")), index=int(g.get("index", 0)),
                                  total_bytes=int(g.get("total_bytes", 0)))
                for g in a.gpus if isinstance(g, dict)]))
        return out


def _agent(kv) -> R.AgentValue | None:
    if kv is None:
        return None
    try:
        return R.AgentValue.load(kv.value)
    except (ValueError, TypeError):
        return None
