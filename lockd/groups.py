"""Groups: create, delete, list, and the status picture (from this replica's mirror)."""
from __future__ import annotations

import structlog

from timeslice.common.errors import EtcdUnavailable, InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.lockd import priority as PR
from timeslice.lockd.errors import AlreadyExists, GroupBusy, LimitExceeded, NotFound
from timeslice.lockd.index import StateIndex
from timeslice.lockd.residency import RESIDENT, residency
from timeslice.lockd.revocations import RevocationNotices
from timeslice.proto import lockd_pb2 as pb

MAX_NODES = 1024             # nodes in one group
MAX_GPUS_PER_NODE = 64       # GPU indexes per node of a group, each in 0..MAX_GPU_INDEX
MAX_GPU_INDEX = 1023
MAX_SPEC_BYTES = 128 * 1024  # a group's spec as stored (etcd's own request limit is 1.5 MiB)
MAX_GROUPS = 4096            # groups in the system
MAX_DELETE_TRIES = 8         # reads a DeleteGroup makes while jobs keep queueing on the group

log = structlog.get_logger(__name__)


class Groups:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, revocations: RevocationNotices | None = None,
                 max_groups: int = MAX_GROUPS):
        self.client, self.keys, self.index = client, keys, index
        self.max_groups = max_groups
        self.revocations = revocations or RevocationNotices(client, keys)

    async def create(self, group: str, nodes: list[tuple[str, list[int]]], isolation: str = "",
                     tenants: list[str] | None = None, admins: list[str] | None = None,
                     priorities: tuple[bool, int, int] = (False, 0, 0), sharing: str = "") -> R.GroupSpec:
        """``tenants``/``admins``: who may acquire and who administers it (lockd/tenancy.py), validated there;
        ``priorities``: (on, max_overtakes, max_wait_ms), lockd/priority.py; ``sharing``: "" or
        "exclusive" (one holder at a time), "fit" (lockd/weights.py)."""
        check_id("group", group)
        sharing = sharing or R.SHARING_EXCLUSIVE
        if sharing not in R.SHARINGS:
            raise InvalidIdError(f"sharing must be one of {sorted(R.SHARINGS)}, got {sharing[:32]!r}")
        on = bool(priorities[0])
        max_overtakes, max_wait_ms = PR.check_bounds(on, *priorities[1:])
        if isolation not in R.ISOLATIONS:
            raise InvalidIdError(f"isolation must be one of {sorted(R.ISOLATIONS)}, got {isolation[:32]!r}")
        if len(nodes) > MAX_NODES:
            raise InvalidIdError(f"limit max_nodes: a group has at most {MAX_NODES} nodes, got {len(nodes)}")
        seen = set()
        for node, gpus in nodes:
            check_id("node", node)
            if node in seen:
                raise InvalidIdError(f"node {node!r} listed twice")
            seen.add(node)
            if len(gpus) > MAX_GPUS_PER_NODE:
                raise InvalidIdError(f"limit max_gpus_per_node: node {node!r} lists {len(gpus)} GPUs, "
                                     f"at most {MAX_GPUS_PER_NODE}")
            if any(not 0 <= g <= MAX_GPU_INDEX for g in gpus):
                raise InvalidIdError(f"gpu indices must be in 0..{MAX_GPU_INDEX}")
        spec = R.GroupSpec([{"node": n, "gpus": sorted(set(g))} for n, g in nodes], R.now_ms(), isolation,
                           list(tenants or []), list(admins or []), on, max_overtakes, max_wait_ms, sharing)
        size = len(spec.dump())
        if size > MAX_SPEC_BYTES:
            raise InvalidIdError(f"limit max_spec_bytes: the group spec is {size} bytes, at most {MAX_SPEC_BYTES}")
        key = self.keys.spec(group)
        existing = self.index.groups.get(group)
        if (existing is None or existing.spec is None) and \
                sum(1 for gs in self.index.groups.values() if gs.spec is not None) >= self.max_groups:
            raise LimitExceeded(f"limit max_groups: there are {self.max_groups} groups already; delete one first")
        # Create-if-absent; re-creating with the same nodes is a harmless retry.
        resp = await self.client.txn([ops.create_rev(key, "==", 0)], [ops.put(key, spec.dump())], [ops.get(key)])
        if not resp.succeeded:
            old = R.GroupSpec.load(resp.responses[0].response_range.kvs[0].value)
            if (old.nodes, old.isolation, old.tenants, old.admins, old.sharing, *_bounds(old)) != \
                    (spec.nodes, spec.isolation, spec.tenants, spec.admins, spec.sharing, *_bounds(spec)):
                names = old.node_names()
                shown = " ".join(names[:8]) + (f" ... ({len(names)} nodes)" if len(names) > 8 else "")
                raise AlreadyExists(f"group {group!r} exists with other nodes, isolation, tenants, "
                                    f"priorities or sharing: {shown}")
            return old
        return spec

    async def delete(self, group: str, force: bool) -> bool:
        """Delete ``group`` with its queue and grant. Busy (a job queued) unless ``force``; then every
        queued job is told first (revocations.py). The delete is guarded by what was read, so a job
        that queues meanwhile (on any replica) makes it look again: it is told too, or (without
        ``force``) the group is busy. Never a hold nobody is told of, never a queue left without a spec."""
        check_id("group", group)
        spec_key, queue = self.keys.spec(group), self.keys.queue(group)
        moving = self.keys.movings(group)
        for _ in range(MAX_DELETE_TRIES):
            # Spec, queue, grant and entries being moved (priority groups: rekey.py) at one revision:
            # the picture the guarded delete below compares with.
            r = await self.client.txn([], [ops.get(spec_key), ops.get(queue, prefix=True), ops.get(self.keys.grant(group)),
                                           ops.get(moving, prefix=True), ops.get(self.keys.grants(group), prefix=True)])
            spec_kvs, queued = r.responses[0].response_range.kvs, list(r.responses[1].response_range.kvs)
            grant_kvs, queued_moving = r.responses[2].response_range.kvs, r.responses[3].response_range.kvs
            grant_kvs = list(grant_kvs) + list(r.responses[4].response_range.kvs)     # a fit group's holders
            if not spec_kvs:
                raise NotFound(f"unknown group {group!r}")
            jobs = {self.keys.parse(q.key)[3] for q in queued}
            queued += [kv for kv in queued_moving if self.keys.parse(kv.key)[3] not in jobs]    # out, not back yet
            if queued and not force:
                raise GroupBusy(f"group {group!r} has {len(queued)} queued job(s); pass force to delete anyway")
            if queued:
                # Notices first: a holder's next Yield (and every KeepAlive) says the group was deleted.
                holders = {R.GrantValue.load(kv.value).job for kv in grant_kvs}
                await self.revocations.notify(group, queued, holders or None)
            # Only if nothing was queued or changed since the read (Acquire's enqueue is guarded by
            # the spec, so none can land after this): else read again.
            resp = await self.client.txn(
                [ops.mod_rev(spec_key, "==", spec_kvs[0].mod_revision), ops.mod_revs_below(queue, r.header.revision + 1),
                 ops.mod_revs_below(moving, r.header.revision + 1)],
                [ops.delete(self.keys.group(group), prefix=True)])
            if resp.succeeded:
                return resp.responses[0].response_delete_range.deleted > 0
            log.info("group_delete_raced", group=group, why="a job queued or its entry changed since the read")
        raise EtcdUnavailable(f"group {group!r} kept changing while it was being deleted; try again")

    def list(self) -> list[pb.Group]:
        out = []
        for g, gs in sorted(self.index.groups.items()):
            if gs.spec is not None:
                spec = R.GroupSpec.load(gs.spec.value)
                out.append(pb.Group(group_id=g, nodes=_nodes(spec), isolation=spec.isolation,
                                    tenants=spec.tenants, admins=spec.admins, sharing=spec.sharing,
                                    **priorities_of(spec)))
        return out

    def status(self, group: str, epoch: int, revision: int) -> pb.GroupStatus:
        check_id("group", group)
        gs = self.index.groups.get(group)
        if gs is None or gs.spec is None:
            raise NotFound(f"unknown group {group!r}")
        spec = R.GroupSpec.load(gs.spec.value)
        held = gs.holders()
        grants = sorted((R.GrantValue.load(kv.value) for kv in held.values()), key=lambda g: g.token)
        st = pb.GroupStatus(group_id=group, nodes=_nodes(spec), leader_epoch=epoch, revision=revision,
                            sharing=spec.sharing, holders=[_grant(g) for g in grants], **priorities_of(spec))
        if spec.shared:
            # Every holder is in ``holders``; ``holder`` is the oldest (else the head), the waiters the rest.
            order = PR.order(gs, spec, R.now_ms(), held)
            first = [(g.job, gs.queue[g.job]) for g in grants[:1] if g.job in gs.queue]
            fifo = first + [(j, kv) for j, kv in order if j not in held]
        else:
            fifo = PR.order(gs, spec, R.now_ms()) if spec.priorities else gs.fifo()
        if fifo:
            st.holder.CopyFrom(_waiter(*fifo[0]))
            st.waiters.extend(_waiter(j, kv) for j, kv in fifo[1:])
        mine = next((g for g in st.holders if fifo and g.job_id == fifo[0][0]), None)
        if mine is not None:
            st.grant.CopyFrom(mine)
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
        agent = R.AgentValue.load(ns.agent.value) if ns and ns.agent else None
        out.resident_jobs.extend(j for j in on_node if residency(ns, j, True, agent) in RESIDENT)
        for job in sorted(set(on_node) | set(ns.statuses if ns else ())):
            kv = ns.statuses.get(job) if ns else None
            if kv is None:
                out.jobs.append(pb.JobState(job_id=job, state=R.RUNNING))
                continue
            s = R.StatusValue.load(kv.value)
            out.jobs.append(pb.JobState(job_id=job, state=s.state, bytes=s.bytes, elapsed_ms=s.elapsed_ms,
                                        error=s.error, token=s.token, since_unix_ms=s.updated_ms,
                                        device_bytes=s.device_bytes, residue_bytes=s.residue_bytes))
        return out


def priorities_of(spec: R.GroupSpec) -> dict:
    """A group's priority fields as the replies carry them."""
    return {"priorities": spec.priorities, "max_overtakes": spec.max_overtakes,
            "max_wait_s": spec.max_wait_ms // 1000}


def _bounds(spec: R.GroupSpec) -> tuple[bool, int, int]:
    return spec.priorities, spec.max_overtakes, spec.max_wait_ms


def _grant(g: R.GrantValue) -> pb.Grant:
    return pb.Grant(job_id=g.job, token=g.token, leader_epoch=g.leader_epoch, restored=g.restored, elided=g.elided,
                    bytes_moved=g.bytes_moved, granted_unix_ms=g.granted_ms,
                    footprint_bytes={str(k): int(v) for k, v in g.footprint.items()}, exclusive=g.exclusive,
                    backfilled=g.backfilled)


def _waiter(job: str, kv) -> pb.Waiter:
    return pb.Waiter(job_id=job, token=kv.create_revision, priority=R.QueueValue.load(kv.value).priority)


def _nodes(spec: R.GroupSpec) -> list[pb.NodeSpec]:
    return [pb.NodeSpec(node=n["node"], gpus=n.get("gpus", [])) for n in spec.nodes]
