"""Groups: create, delete, list, and the status picture (from this replica's mirror)."""
from __future__ import annotations

from lockd.errors import AlreadyExists, GroupBusy, NotFound
from lockd.index import StateIndex
from lockd.plan import residency
from tsproto import lockd_pb2 as pb
from tscore import records as R
from tscore.errors import InvalidIdError
from tscore.etcd import ops
from tscore.etcd.client import EtcdClient
from tscore.ids import check_id
from tscore.keys import Keys

MAX_NODES = 1024


class Groups:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex):
        self.client, self.keys, self.index = client, keys, index

    async def create(self, group: str, nodes: list[tuple[str, list[int]]], isolation: str = "") -> R.GroupSpec:
        check_id("group", group)
        if isolation not in R.ISOLATIONS:
            raise InvalidIdError(f"isolation must be one of {sorted(R.ISOLATIONS)}, got {isolation[:32]!r}")
        if len(nodes) > MAX_NODES:
            raise InvalidIdError(f"a group has at most {MAX_NODES} nodes")
        seen = set()
        for node, gpus in nodes:
            check_id("node", node)
            if node in seen:
                raise InvalidIdError(f"node {node!r} listed twice")
            seen.add(node)
            if any(g < 0 for g in gpus):
                raise InvalidIdError("gpu indices must be >= 0")
        spec = R.GroupSpec([{"node": n, "gpus": sorted(set(g))} for n, g in nodes], R.now_ms(), isolation)
        key = self.keys.spec(group)
        # Create-if-absent; re-creating with the same nodes is a harmless retry.
        resp = await self.client.txn([ops.create_rev(key, "==", 0)], [ops.put(key, spec.dump())], [ops.get(key)])
        if not resp.succeeded:
            old = R.GroupSpec.load(resp.responses[0].response_range.kvs[0].value)
            if old.nodes != spec.nodes or old.isolation != spec.isolation:
                raise AlreadyExists(f"group {group!r} exists with other nodes or isolation: {old.node_names()}")
            return old
        return spec

    async def delete(self, group: str, force: bool) -> bool:
        check_id("group", group)
        if not (await self.client.range(ops.range_req(self.keys.spec(group)))).kvs:
            raise NotFound(f"unknown group {group!r}")
        r = await self.client.range(ops.range_req(self.keys.queue(group), prefix=True, count_only=True))
        if r.count and not force:
            raise GroupBusy(f"group {group!r} has {r.count} queued job(s); pass force to delete anyway")
        # A job that queues in between is deleted with the group; its waiter is
        # woken by the spec's deletion and told the group is gone (never lost).
        resp = await self.client.txn([], [ops.delete(self.keys.group(group), prefix=True)])
        return resp.responses[0].response_delete_range.deleted > 0

    def list(self) -> list[pb.Group]:
        out = []
        for g, gs in sorted(self.index.groups.items()):
            if gs.spec is not None:
                spec = R.GroupSpec.load(gs.spec.value)
                out.append(pb.Group(group_id=g, nodes=_nodes(spec), isolation=spec.isolation))
        return out

    def status(self, group: str, epoch: int, revision: int) -> pb.GroupStatus:
        check_id("group", group)
        gs = self.index.groups.get(group)
        if gs is None or gs.spec is None:
            raise NotFound(f"unknown group {group!r}")
        spec = R.GroupSpec.load(gs.spec.value)
        fifo = gs.fifo()
        st = pb.GroupStatus(group_id=group, nodes=_nodes(spec), leader_epoch=epoch, revision=revision)
        if fifo:
            st.holder.CopyFrom(pb.Waiter(job_id=fifo[0][0], token=fifo[0][1].create_revision))
            st.waiters.extend(pb.Waiter(job_id=j, token=kv.create_revision) for j, kv in fifo[1:])
        if gs.grant is not None:
            g = R.GrantValue.load(gs.grant.value)
            st.grant.CopyFrom(pb.Grant(job_id=g.job, token=g.token, leader_epoch=g.leader_epoch,
                                       restored=g.restored, elided=g.elided, bytes_moved=g.bytes_moved,
                                       granted_unix_ms=g.granted_ms))
        for node in spec.node_names():
            st.node_status.append(self._node_status(node))
        return st

    def _node_status(self, node: str) -> pb.NodeStatus:
        ns = self.index.nodes.get(node)
        out = pb.NodeStatus(node=node, agent_alive=bool(ns and ns.agent))
        if ns and ns.agent:
            a = R.AgentValue.load(ns.agent.value)
            out.backend, out.device_free_bytes, out.device_total_bytes = a.backend, a.device_free_bytes, \
                a.device_total_bytes
        on_node = sorted(self.index.node_jobs.get(node, ()))
        out.resident_jobs.extend(j for j in on_node if residency(ns, j, True) == "running")
        for job in sorted(set(on_node) | set(ns.statuses if ns else ())):
            kv = ns.statuses.get(job) if ns else None
            if kv is None:
                out.jobs.append(pb.JobState(job_id=job, state=R.RUNNING))
                continue
            s = R.StatusValue.load(kv.value)
            out.jobs.append(pb.JobState(job_id=job, state=s.state, bytes=s.bytes, elapsed_ms=s.elapsed_ms,
                                        error=s.error, token=s.token, since_unix_ms=s.updated_ms,
                                        device_bytes=s.device_bytes))
        return out


def _nodes(spec: R.GroupSpec) -> list[pb.NodeSpec]:
    return [pb.NodeSpec(node=n["node"], gpus=n.get("gpus", [])) for n in spec.nodes]
