"""GetProfiles: the jobs' profiles, the groups and the nodes' capacities, from this replica's mirror.

What ``timeslice profile`` shows and ``timeslice advise`` plans with. The profiles
are read off the history of finished holds (lockd/profiles.py over
lockd/history.py's records), so any replica answers and a reader never waits for
an election. Built once per mirror revision: a scrape or a second call at the same
revision costs nothing.
"""
from __future__ import annotations

from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.lockd import profiles as P
from timeslice.lockd.groups import Groups
from timeslice.lockd.index import StateIndex
from timeslice.proto import lockd_pb2 as pb


class ProfileService:
    def __init__(self, keys: Keys, index: StateIndex, reflector: Reflector, groups: Groups,
                 phases: int = P.DEFAULT_PHASES):
        self.keys, self.index, self.reflector, self.groups, self.phases = keys, index, reflector, groups, phases
        self._cache: tuple[int, list[P.Profile]] = (-1, [])

    def profiles(self) -> list[P.Profile]:
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
            self._cache = (rev, P.build(records, agents, nodes_of, self.phases))
        return self._cache[1]

    def _live(self, job: str) -> bool:
        js = self.index.jobs.get(job)
        return js is not None and js.session is not None

    def fractions(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(group, job) -> (busy, wait) share of the live jobs' recent cycles."""
        return {(p.group, p.job): P.fractions(p) for p in self.profiles() if self._live(p.job)}

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
