"""GetProfiles: the stored profiles, the groups and the nodes' capacities, from this replica's mirror.

What ``timeslice profile`` shows and ``timeslice advise`` plans with. Any
replica answers (the leader writes the profiles every few seconds; see
profile_recorder.py), so a reader never waits for an election.
"""
from __future__ import annotations

from timeslice.common import records as R
from timeslice.common.etcd.mirror import Reflector
from timeslice.common.ids import check_id
from timeslice.common.keys import Keys
from timeslice.lockd.groups import Groups
from timeslice.lockd.index import StateIndex
from timeslice.lockd.profile_recorder import load_stored
from timeslice.proto import lockd_pb2 as pb


class ProfileService:
    def __init__(self, keys: Keys, index: StateIndex, reflector: Reflector, groups: Groups):
        self.keys, self.index, self.reflector, self.groups = keys, index, reflector, groups

    def get(self, job: str = "", group: str = "") -> pb.ProfilesReply:
        if job:
            check_id("job", job)
        if group:
            check_id("group", group)
        stored = load_stored(self.keys, (kv for _, kv in self.reflector.items(self.keys.profiles())))
        out = pb.ProfilesReply()
        for p in sorted(stored, key=lambda p: (p.group, p.job)):
            if (job and p.job != job) or (group and p.group != group):
                continue
            js = self.index.jobs.get(p.job)
            out.profiles.append(pb.Profile(
                job_id=p.job, group_id=p.group, hold_ms=p.hold_ms, gap_ms=p.gap_ms, wait_ms=p.wait_ms,
                snapshot_ms=p.snapshot_ms, restore_ms=p.restore_ms, swap_bytes=p.swap_bytes, busy_ms=p.busy_ms,
                gpu_bytes={str(k): int(v) for k, v in p.gpu_bytes.items()}, device_bytes=p.device_bytes,
                host_bytes=p.host_bytes, grants=p.grants, elided=p.elided, restored=p.restored,
                first_unix_ms=p.first_ms, updated_unix_ms=p.updated_ms,
                live=bool(js is not None and js.session is not None)))
        out.groups.extend(self.groups.list())
        for node, ns in sorted(self.index.nodes.items()):
            if ns.agent is None:
                continue
            try:
                a = R.AgentValue.load(ns.agent.value)
            except (ValueError, TypeError):
                continue
            out.nodes.append(pb.NodeCapacity(node=node, host_free_bytes=a.host_free_bytes, gpus=[
                pb.DeviceCapacity(id=str(g.get("uuid", "")), index=int(g.get("index", 0)),
                                  total_bytes=int(g.get("total_bytes", 0)))
                for g in a.gpus if isinstance(g, dict)]))
        return out
