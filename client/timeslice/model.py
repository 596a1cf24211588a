"""What the client returns: small frozen dataclasses, converted from the protos here.

Callers never see protobuf messages. Every type has ``to_dict()`` (plain JSON
types, stable keys) for ``timeslice ... --json`` and for scripts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from timeslice.proto import lockd_pb2 as pb


class _Dict:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass


@dataclass(frozen=True)
class Grant(_Dict):
    """The result of acquire(): this job holds ``group_id`` under fencing ``token``."""

    group_id: str
    job_id: str
    token: int                 # fencing token: strictly increasing per group; carried by yield
    leader_epoch: int          # epoch of the lockd leader that granted
    waited_ms: float           # from the request's arrival at lockd to the grant
    restored: bool             # this job's context was restored onto the devices for this grant
    elided: bool               # another job stayed resident beside this one (nothing moved)
    bytes_moved: int           # snapshot + restore bytes moved on this job's behalf
    # Groups with sharing "fit": what the grant weighs ("<node>/<GPU>" -> admitted bytes; empty when
    # exclusive), whether it weighs the whole device, and whether it went before an earlier waiter.
    footprint_bytes: dict = field(default_factory=dict)
    exclusive: bool = False
    backfilled: bool = False

    @classmethod
    def from_pb(cls, r: pb.AcquireReply) -> Grant:
        return cls(r.group_id, r.job_id, r.token, r.leader_epoch, r.waited_ms, r.restored,
                   r.elided, r.bytes_moved, dict(r.footprint_bytes), r.exclusive, r.backfilled)


@dataclass(frozen=True)
class Released(_Dict):
    """The result of yield_()."""

    group_id: str
    token: int
    released: bool             # False: the job was not queued any more (an earlier attempt released it)
    deferred_snapshot: bool    # nobody waited: the job stays resident until someone needs the GPUs


@dataclass(frozen=True)
class NodeSpec(_Dict):
    node: str
    gpus: tuple[int, ...] = ()   # empty = every GPU of the node

    @classmethod
    def parse(cls, text: str) -> NodeSpec:
        """``"node"`` or ``"node:0,1"`` (GPU indices)."""
        node, sep, gpus = text.partition(":")
        if not sep:
            return cls(node)
        try:
            return cls(node, tuple(int(g) for g in gpus.split(",") if g.strip() != ""))
        except ValueError:
            raise ValueError(f"bad node spec {text!r}: expected NODE or NODE:GPU[,GPU...]") from None

    @classmethod
    def coerce(cls, value: NodeSpec | str | tuple | list) -> NodeSpec:
        if isinstance(value, NodeSpec):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        node, gpus = value
        return cls(node, tuple(gpus or ()))

    def to_pb(self) -> pb.NodeSpec:
        return pb.NodeSpec(node=self.node, gpus=list(self.gpus))

    @classmethod
    def from_pb(cls, n: pb.NodeSpec) -> NodeSpec:
        return cls(n.node, tuple(n.gpus))

    def __str__(self) -> str:
        return self.node + (":" + ",".join(map(str, self.gpus)) if self.gpus else "")


@dataclass(frozen=True)
class Group(_Dict):
    group_id: str
    nodes: tuple[NodeSpec, ...] = ()
    isolation: str = ""          # the group's policy for parked cooperative workers ("": the default)
    tenants: tuple[str, ...] = ()   # whose jobs may acquire it ("*": every tenant)
    admins: tuple[str, ...] = ()    # the tenants that administer it
    priorities: bool = False        # priority classes (else pure FIFO), with its aging bound:
    max_overtakes: int = 0          # a waiter goes first once this many grants were made since it joined
    max_wait_s: int = 0             # ... or once it waited this long (0: no time bound)
    sharing: str = "exclusive"      # "exclusive" (one holder) | "fit" (side by side where footprints fit)

    @classmethod
    def from_pb(cls, g: pb.Group) -> Group:
        return cls(g.group_id, tuple(NodeSpec.from_pb(n) for n in g.nodes), g.isolation, tuple(g.tenants),
                   tuple(g.admins), g.priorities, g.max_overtakes, g.max_wait_s, g.sharing or "exclusive")


@dataclass(frozen=True)
class Waiter(_Dict):
    job_id: str
    token: int
    priority: int = 0               # its class (groups with priorities)


@dataclass(frozen=True)
class GrantInfo(_Dict):
    """The grant as ``status()`` shows it."""

    job_id: str
    token: int
    leader_epoch: int
    restored: bool
    elided: bool
    bytes_moved: int
    granted_unix_ms: int
    footprint_bytes: dict = field(default_factory=dict)   # fit groups: "<node>/<GPU>" -> admitted bytes
    exclusive: bool = False         # fit groups: weighs the whole device
    backfilled: bool = False        # fit groups: granted before an earlier waiter that did not fit

    @classmethod
    def from_pb(cls, g: pb.Grant) -> GrantInfo:
        return cls(g.job_id, g.token, g.leader_epoch, g.restored, g.elided, g.bytes_moved, g.granted_unix_ms,
                   dict(g.footprint_bytes), g.exclusive, g.backfilled)


@dataclass(frozen=True)
class NodeJobState(_Dict):
    job_id: str
    state: str                 # running | snapshotting | snapshotted | restoring | frozen | unknown | gone | lost
    bytes: int = 0
    elapsed_ms: float = 0.0
    error: str = ""
    token: int = 0
    since_unix_ms: int = 0     # when the agent wrote this state; for a snapshotted job: parked since
    device_bytes: int = 0      # footprint on the node (snapshotted: what a restore brings back)
    residue_bytes: int = 0     # parked cooperatively: what it still holds on the node's devices


@dataclass(frozen=True)
class NodeStatus(_Dict):
    node: str
    agent_alive: bool
    backend: str
    resident_jobs: tuple[str, ...]
    jobs: tuple[NodeJobState, ...]
    device_free_bytes: int
    device_total_bytes: int


@dataclass(frozen=True)
class GroupStatus(_Dict):
    group_id: str
    nodes: tuple[NodeSpec, ...]
    holder: Waiter | None          # head of the queue (granted, or being swapped in)
    grant: GrantInfo | None        # set once the holder is granted
    waiters: tuple[Waiter, ...]    # behind the holder, FIFO
    node_status: tuple[NodeStatus, ...]
    leader_epoch: int
    revision: int = field(default=0, compare=False)   # etcd revision the picture was read at
    sharing: str = "exclusive"     # "exclusive" | "fit"
    holders: tuple[GrantInfo, ...] = ()   # every holder's grant, in grant order (fit groups: several)

    @classmethod
    def from_pb(cls, s: pb.GroupStatus) -> GroupStatus:
        holder = Waiter(s.holder.job_id, s.holder.token, s.holder.priority) \
            if s.HasField("holder") and s.holder.job_id else None
        grant = GrantInfo.from_pb(s.grant) if s.HasField("grant") and s.grant.job_id else None
        nodes = tuple(
            NodeStatus(n.node, n.agent_alive, n.backend, tuple(n.resident_jobs),
                       tuple(NodeJobState(j.job_id, j.state, j.bytes, j.elapsed_ms, j.error, j.token,
                                              j.since_unix_ms, j.device_bytes, j.residue_bytes)
                             for j in n.jobs),
                       n.device_free_bytes, n.device_total_bytes)
            for n in s.node_status)
        return cls(s.group_id, tuple(NodeSpec.from_pb(n) for n in s.nodes), holder, grant,
                   tuple(Waiter(w.job_id, w.token, w.priority) for w in s.waiters), nodes, s.leader_epoch, s.revision,
                   s.sharing or "exclusive", tuple(GrantInfo.from_pb(h) for h in s.holders))

    @property
    def queue(self) -> tuple[Waiter, ...]:
        """Holder first, then the waiters: the whole FIFO."""
        return ((self.holder,) if self.holder else ()) + self.waiters


@dataclass(frozen=True)
class JobInfo(_Dict):
    job_id: str
    lease_id: int
    groups: tuple[str, ...]
    workers: int
    tenant: str = ""             # its session's tenant ("*": opened with the admin token; "": no tenants)
    holds: tuple[HeldGroup, ...] = ()  # the groups it holds now, each with what its grant weighs

    @classmethod
    def from_pb(cls, j: pb.JobInfo) -> JobInfo:
        return cls(j.job_id, j.lease_id, tuple(j.groups), j.workers, j.tenant,
                   tuple(HeldGroup(h.group_id, h.token, dict(h.footprint_bytes), h.exclusive) for h in j.holds))


@dataclass(frozen=True)
class HeldGroup(_Dict):
    """A group a job holds (``jobs()``), with what its grant weighs."""

    group_id: str
    token: int
    footprint_bytes: dict = field(default_factory=dict)   # fit groups: "<node>/<GPU>" -> admitted bytes
    exclusive: bool = True          # weighs the whole device (every exclusive group's hold)


def node_specs(nodes: Iterable[NodeSpec | str | tuple] | None) -> list[NodeSpec]:
    return [NodeSpec.coerce(n) for n in (nodes or ())]


@dataclass(frozen=True)
class Worker(_Dict):
    """A registered worker process of the job (see register_worker)."""

    node: str
    pid: int
    device_bytes: int = 0
