"""StateIndex: the reflector's mirror, organised by group, node and job.

The reflector holds raw keys; the scheduler and the Acquire waiters need
"the queue of group g in FIFO order" or "the workers of job j on node n" in
O(size of the answer), not by scanning every key. The index is updated
incrementally from each watch batch and rebuilt on a reflector reset.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from aetcd import rpc

from timeslice.common.server.etcd.watch import WatchEvent
from timeslice.common.server.keys import Keys
from timeslice.common.server.records import GrantValue, GroupSpec, StatusValue

KV: TypeAlias = rpc.KeyValue   # aetcd ships no type information: Any, named for the reader


@dataclass
class GroupState:
    spec: KV | None = None
    queue: dict[str, KV] = field(default_factory=dict)      # job -> queue entry
    grant: KV | None = None
    failures: dict[str, KV] = field(default_factory=dict)   # job -> failure
    parsed: GroupSpec | None = None                         # spec, parsed once per change
    turns: KV | None = None                                 # priority groups, fit groups that backfilled
    moving: dict[str, KV] = field(default_factory=dict)     # job -> its entry being re-keyed (lockd/rekey.py)
    shared: dict[str, KV] = field(default_factory=dict)     # fit groups: job -> its grant (grants/<job>)

    def fifo(self) -> list[tuple[str, KV]]:
        """Queue entries in FIFO order (create revision = token).

        ``queue`` is kept in that order: a new key's event arrives in revision
        order and is appended; an update keeps the key's place; ``rebuild``
        sorts once. So this is a copy, never a sort on the hot path.
        """
        return list(self.queue.items())

    def head(self) -> tuple[str, KV] | None:
        return next(iter(self.queue.items()), None)

    def holders(self) -> dict[str, KV]:
        """job -> grant of every holder: an exclusive group's one grant (``grant``), a fit group's
        grants (``shared``, one per holder), in grant order (tokens increase in grant order)."""
        if self.grant is None:
            return dict(self.shared)
        job = _grant_job(self.grant)
        out = {job: self.grant} if job is not None else {}
        out.update(self.shared)
        return out

    def grant_of(self, job: str) -> KV | None:
        """``job``'s grant of the group, if it holds one (either layout)."""
        kv = self.shared.get(job)
        if kv is None and self.grant is not None and _grant_job(self.grant) == job:
            kv = self.grant
        return kv

    def granted(self) -> bool:
        return self.grant is not None or bool(self.shared)


@dataclass
class NodeState:
    agent: KV | None = None
    intents: dict[str, KV] = field(default_factory=dict)    # job -> intent
    statuses: dict[str, KV] = field(default_factory=dict)   # job -> status


def status_of(ns: NodeState | None, job: str) -> StatusValue | None:
    """The status the node's agent reports for ``job`` (None: no node, or no status)."""
    kv = ns.statuses.get(job) if ns else None
    return StatusValue.load(kv.value) if kv else None


@dataclass
class JobState:
    session: KV | None = None
    workers: dict[tuple[str, int], KV] = field(default_factory=dict)  # (node, pid) -> worker

    def nodes(self) -> set[str]:
        return {n for n, _ in self.workers}


class StateIndex:
    def __init__(self, keys: Keys):
        self.keys = keys
        self.groups: dict[str, GroupState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[str, JobState] = {}
        self.leader: dict[bytes, KV] = {}
        self.node_jobs: dict[str, set[str]] = {}      # node -> jobs with workers there
        self.node_groups: dict[str, set[str]] = {}    # node -> groups whose spec lists it
        self.job_grants: dict[str, set[str]] = {}     # job -> groups whose grant names it
        self.slots: dict[str, set[int]] = {}          # limit's space -> slots taken (lockd/slots.py)
        self._released: set[str] = set()              # groups whose holder let go, this batch

    def rebuild(self, kvs: dict[bytes, KV]) -> None:
        self.groups, self.nodes, self.jobs, self.leader, self.node_jobs = {}, {}, {}, {}, {}
        self.node_groups, self.job_grants = {}, {}
        self.slots = {}
        for kv in sorted(kvs.values(), key=lambda kv: kv.create_revision):
            self._apply(kv.key, kv)
        self._released.clear()

    def apply(self, events: list[WatchEvent]) -> set[tuple[str, str]]:
        """Apply a batch; returns what it touched as {("group"|"node"|"job", id)}."""
        touched: set[tuple[str, str]] = set()
        for ev in events:
            t = self._apply(ev.kv.key, ev.kv if ev.is_put else None)
            if t is not None:
                touched.add(t)
        # ("released", g): g's holder yielded or died; heads of other groups may have waited on it.
        touched.update(("released", g) for g in self._released)
        self._released.clear()
        return touched

    def _apply(self, key: bytes, kv: KV | None) -> tuple[str, str] | None:
        try:
            parts = self.keys.parse(key)
        except ValueError:
            return None
        kind = parts[0]
        if kind == "groups" and len(parts) >= 3:
            return self._apply_group(parts, kv)
        if kind == "nodes" and len(parts) >= 3:
            return self._apply_node(parts, kv)
        if kind == "jobs" and len(parts) >= 3:
            return self._apply_job(parts, kv)
        if kind == "slots" and len(parts) >= 3 and parts[-1].isdigit():
            self._apply_slot("/".join(parts[1:-1]), int(parts[-1]), kv)
        if kind == "leader":
            _set(self.leader, key, kv)
        return None

    def _apply_slot(self, space: str, n: int, kv: KV | None) -> None:
        taken = self.slots.setdefault(space, set())
        if kv is not None:
            taken.add(n)
            return
        taken.discard(n)
        if not taken:
            del self.slots[space]

    def slots_taken(self, space: str) -> frozenset[int]:
        """The slots of ``space`` taken as this mirror shows them (a copy)."""
        return frozenset(self.slots.get(space, ()))

    def _apply_group(self, parts, kv) -> tuple[str, str]:
        g = parts[1]
        gs = self.groups.setdefault(g, GroupState())
        sub = parts[2]
        if sub == "spec":
            # Keep node -> groups current: agents refresh their keys every few seconds and
            # each refresh asks which groups a node serves; parse a spec once, not per ask.
            for nodes in self.node_groups.values():
                nodes.discard(g)
            gs.spec = kv
            gs.parsed = _spec(kv)
            for node in (gs.parsed.node_names() if gs.parsed is not None else ()):
                self.node_groups.setdefault(node, set()).add(g)
        elif sub == "grant":
            # Keep job -> held groups current: the planner asks it for every resident it
            # would snapshot (a holder is never parked on its group's devices).
            old = _grant_job(gs.grant)
            gs.grant = kv
            new = _grant_job(kv)
            if old is not None and old != new:
                self._let_go(g, old)
            if new is not None:
                self.job_grants.setdefault(new, set()).add(g)
        elif sub == "grants" and len(parts) == 4:
            # A fit group's holder (one key each): the same index, job from the key.
            job = parts[3]
            had = job in gs.shared
            _set(gs.shared, job, kv)
            if kv is None and had:
                self._let_go(g, job)
            elif kv is not None:
                self.job_grants.setdefault(job, set()).add(g)
        elif sub == "queue" and len(parts) == 4:
            _set(gs.queue, parts[3], kv)
        elif sub == "failures" and len(parts) == 4:
            _set(gs.failures, parts[3], kv)
        elif sub == "turns":
            gs.turns = kv
        elif sub == "moving" and len(parts) == 4:
            _set(gs.moving, parts[3], kv)
        if gs.spec is None and not gs.queue and gs.grant is None and not gs.failures and gs.turns is None \
                and not gs.moving and not gs.shared:
            del self.groups[g]
        return ("group", g)

    def _let_go(self, group: str, job: str) -> None:
        """``job`` no longer holds ``group``: heads elsewhere may have waited on it (``released``)."""
        self._released.add(group)
        held = self.job_grants.get(job)
        if held is not None:
            held.discard(group)
            if not held:
                del self.job_grants[job]

    def _apply_node(self, parts, kv) -> tuple[str, str]:
        n = parts[1]
        ns = self.nodes.setdefault(n, NodeState())
        sub = parts[2]
        if sub == "agent":
            ns.agent = kv
        elif sub == "intents" and len(parts) == 4:
            _set(ns.intents, parts[3], kv)
        elif sub == "status" and len(parts) == 4:
            _set(ns.statuses, parts[3], kv)
        return ("node", n)

    def _apply_job(self, parts, kv) -> tuple[str, str]:
        j = parts[1]
        js = self.jobs.setdefault(j, JobState())
        if parts[2] == "session":
            js.session = kv
        elif parts[2] == "workers" and len(parts) == 5 and parts[4].isdigit():
            node = parts[3]
            _set(js.workers, (node, int(parts[4])), kv)
            if node in js.nodes():
                self.node_jobs.setdefault(node, set()).add(j)
            else:
                self.node_jobs.get(node, set()).discard(j)
        if js.session is None and not js.workers:
            del self.jobs[j]
        return ("job", j)

    def leader_candidate(self) -> KV | None:
        """The election key with the lowest create revision: the current leader's, as mirrored."""
        return min(self.leader.values(), key=lambda kv: kv.create_revision, default=None)

    def groups_on_node(self, node: str) -> list[str]:
        return sorted(self.node_groups.get(node, ()))

    def specs_held_by(self, job: str, released: tuple[str, str] | None = None) -> list[GroupSpec]:
        """The specs of the groups ``job`` holds a grant on now (less ``released``: (job, group)
        whose grant is being handed on)."""
        out = []
        for g in sorted(self.job_grants.get(job, ())):
            gs = self.groups.get(g)
            if released == (job, g):
                continue
            if gs is not None and gs.parsed is not None:
                out.append(gs.parsed)
        return out

    def groups_of_job(self, job: str) -> list[str]:
        return [g for g, gs in self.groups.items() if job in gs.queue]


def _spec(kv: KV | None) -> GroupSpec | None:
    try:
        return GroupSpec.load(kv.value) if kv is not None else None
    except (ValueError, TypeError):
        return None


def _grant_job(kv: KV | None) -> str | None:
    try:
        return GrantValue.load(kv.value).job if kv is not None else None
    except (ValueError, TypeError):
        return None


def _set(d: dict, k, kv) -> None:
    if kv is None:
        d.pop(k, None)
    else:
        d[k] = kv
