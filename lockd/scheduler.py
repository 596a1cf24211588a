"""The leader's scheduler: runs plan.py per group and applies its actions.

Only the leader runs it. Every write is a transaction guarded by the leader
epoch (``Leadership.txn``) and by the token or revision it acts on, so a
deposed leader writes nothing and a repeated write is a harmless no-op.
Groups are worked on concurrently, each by at most one task at a time.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from timeslice.common.errors import NotLeader, OutcomeUnknown, TimesliceError
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.election import Leadership
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.lockd import plan as P
from timeslice.lockd import priority as PR
from timeslice.lockd import rekey as RK
from timeslice.lockd.cleanup import plan_cleanup
from timeslice.lockd.index import StateIndex
from timeslice.lockd.metrics import LockdMetrics

log = structlog.get_logger(__name__)


class Scheduler:
    def __init__(self, leadership: Leadership, keys: Keys, index: StateIndex, reflector: Reflector,
                 policy: P.Policy, metrics: LockdMetrics, tick: float = 1.0, cleanup_every: int = 10):
        self.lead, self.keys, self.index, self.reflector = leadership, keys, index, reflector
        self.policy, self.metrics, self.tick, self.cleanup_every = policy, metrics, tick, cleanup_every
        self._dirty: set[str] = set()
        self._workers: dict[str, asyncio.Task] = {}
        self._head_seen: dict[str, tuple[int, float]] = {}   # group -> (token, first seen)
        self._swap_start: dict[str, tuple[int, float]] = {}
        self._blocked: set[str] = set()       # groups whose head waits and whose last plan wrote nothing
        self.deposed = asyncio.Event()
        self.deposed_reason = ""

    # --- triggering ------------------------------------------------------------
    def on_touched(self, touched: set[tuple[str, str]]) -> None:
        for kind, ident in touched:
            if kind == "group":
                self._mark(ident)
            elif kind == "node":
                for g in self.index.groups_on_node(ident):
                    self._mark(g)
            elif kind == "job":
                for g in self.index.groups_of_job(ident):
                    self._mark(g)
            elif kind == "released":
                # A holder let go: a waiting head of a group on the same nodes may have been
                # kept from parking it (plan: a holder is never snapshotted). Re-plan those now
                # rather than at the next tick.
                gs = self.index.groups.get(ident)
                for node in (gs.parsed.node_names() if gs is not None and gs.parsed is not None else ()):
                    for g in self.index.groups_on_node(node):
                        if g in self._blocked:
                            self._mark(g)

    def mark_all(self) -> None:
        for g in list(self.index.groups):
            self._mark(g)

    def _mark(self, group: str) -> None:
        self._dirty.add(group)
        if group not in self._workers and not self.deposed.is_set():
            self._workers[group] = asyncio.create_task(self._work(group), name=f"sched-{group}")

    async def run(self) -> None:
        """Re-plan every group each tick (agent timeouts need the clock), until deposed;
        every ``cleanup_every`` ticks, forget the intents and statuses of departed jobs."""
        self.mark_all()
        ticks = 0
        try:
            while not self.deposed.is_set():
                await asyncio.sleep(self.tick)
                self.mark_all()
                ticks += 1
                if ticks % self.cleanup_every == 0:
                    await self._cleanup()
        finally:
            for t in list(self._workers.values()):
                t.cancel()

    # --- one group -------------------------------------------------------------
    async def _work(self, group: str) -> None:
        try:
            while group in self._dirty and not self.deposed.is_set():
                self._dirty.discard(group)
                gs = self.index.groups.get(group)
                if gs is None:
                    self._blocked.discard(group)
                    continue
                self._note_head(group, gs)
                actions = P.plan_group(gs, self.index.nodes, self.index.jobs, R.now_ms(), self.policy,
                                       self.index.node_jobs, self.index.specs_held_by)
                if not actions and _head_waits(gs):
                    self._blocked.add(group)
                else:
                    self._blocked.discard(group)
                revs = []
                for action in actions:
                    rev = await self._apply(group, action)
                    if rev:
                        revs.append(rev)
                if revs:
                    # Re-plan only on a mirror that includes our own writes.
                    await self.reflector.wait_revision(max(revs), timeout=10)
                    self._dirty.add(group)
        except NotLeader as e:
            self.deposed_reason = str(e)
            self.deposed.set()
        except OutcomeUnknown as e:
            log.warning("scheduler_outcome_unknown", group=group, error=str(e))
            self._dirty.add(group)        # the mirror will show what happened; re-plan then
        except (TimesliceError, asyncio.TimeoutError) as e:
            log.warning("scheduler_step_failed", group=group, error=str(e))
        finally:
            self._workers.pop(group, None)
            if group in self._dirty and not self.deposed.is_set():
                await asyncio.sleep(0.05)
                self._mark(group)

    async def _cleanup(self) -> None:
        for f in plan_cleanup(self.index.groups, self.index.nodes, self.index.jobs):
            try:
                resp = await self.lead.txn([ops.mod_rev(f.key, "==", f.mod_revision)], [ops.delete(f.key)])
            except NotLeader as e:
                self.deposed_reason = str(e)
                self.deposed.set()
                return
            except TimesliceError as e:
                log.warning("cleanup_failed", key=f.key.decode(errors="replace"), error=str(e))
                return
            if resp.succeeded:
                log.info("forgot", key=f.key.decode(errors="replace"), epoch=self.lead.epoch)

    def _note_head(self, group: str, gs) -> None:
        self.metrics.queue_depth.labels(group).set(len(gs.queue))
        head = PR.planned_head(gs, R.now_ms())
        if head:
            tok = head[1].create_revision
            if self._head_seen.get(group, (0, 0))[0] != tok:
                self._head_seen[group] = (tok, time.monotonic())

    async def _apply(self, group: str, a: P.Action) -> int:
        k, epoch = self.keys, self.lead.epoch
        if isinstance(a, P.WriteGrant):
            qkey, gkey = k.queue_entry(group, a.job), k.grant_key(group, a.job, a.shared)
            gs = self.index.groups.get(group)
            if gs is None or gs.spec is None:
                return 0                      # a deleted group's leftovers are granted to nobody
            grant_val = a.stored(epoch)
            # Also guarded by the spec as planned: a group deleted (or created again) since is granted nothing.
            cmp = [ops.create_rev(qkey, "==", a.token), ops.create_rev(gkey, "==", 0),
                   ops.create_rev(k.spec(group), "==", gs.spec.create_revision)]
            if a.shared:
                # A fit group's holders as planned: nobody granted (or re-granted) since the grants we read
                # (holders may only have left, which only frees room); lockd/weights.py.
                cmp.append(ops.mod_revs_below(k.grants(group), a.holders_rev + 1))
            put = [ops.put(gkey, grant_val.dump(), a.lease)]   # the grant dies with the holder's session
            if a.turns_rev >= 0:
                # Only over the turns key as planned: a raise since (an earlier waiter overtaken) makes this
                # plan stale. A priority group also counts its grants there (the aging clock).
                cmp.append(ops.mod_rev(k.turns(group), "==", a.turns_rev))
                if a.turns_next:
                    put.append(ops.put(k.turns(group), a.turns_next))
            resp = await self.lead.txn(cmp, put)
            if resp.succeeded:
                self.record_grant(group, a.job, a.token, a.restored, a.elided, a.bytes_moved,
                                  shared=grant_shares(a, gs), backfilled=a.backfilled)
            return resp.header.revision if resp.succeeded else 0
        if isinstance(a, P.WriteIntent):
            key = k.intent(a.node, a.job)
            gs = self.index.groups.get(group)
            spec = R.GroupSpec.load(gs.spec.value) if gs is not None and gs.spec is not None else None
            intent_val = R.IntentValue(a.op, a.job, group, a.token, epoch, R.now_ms(),
                                isolation=a.isolation or (spec.isolation if spec else R.ISOLATION_NONE),
                                need_bytes=a.need_bytes)
            resp = await self.lead.txn([ops.mod_rev(key, "==", a.expect_mod_revision)], [ops.put(key, intent_val.dump())])
            if resp.succeeded:
                self._swap_start.setdefault(group, (a.token, time.monotonic()))
                log.info("intent", group=group, job=a.job, node=a.node, op=a.op, token=a.token, epoch=epoch)
            return resp.header.revision if resp.succeeded else 0
        if isinstance(a, P.RaiseTurns):
            gs = self.index.groups.get(group)
            if gs is None or gs.spec is None:
                return 0
            # Over the turns key as planned (a grant or another raise since: plan again), and only
            # on the group's incarnation as planned; durable (no lease): the fence for every entry below.
            resp = await self.lead.txn(
                [ops.mod_rev(k.turns(group), "==", a.expect_mod_revision),
                 ops.create_rev(k.spec(group), "==", gs.spec.create_revision)],
                [ops.put(k.turns(group), a.value)])
            if resp.succeeded:
                log.info("turns_raised", group=group, token=a.token, epoch=epoch)
            return resp.header.revision if resp.succeeded else 0
        if isinstance(a, RK.MoveOut | RK.MoveIn | RK.DropMarker):
            gs = self.index.groups.get(group)
            if gs is None or gs.spec is None:
                return 0
            cmp, put = RK.txn(k, group, a, gs.spec.create_revision)   # guarded as rekey.py says why
            resp = await self.lead.txn(cmp, put)
            if resp.succeeded:
                log.info("rekey", group=group, job=a.job, step=type(a).__name__, epoch=epoch)
            return resp.header.revision if resp.succeeded else 0
        if isinstance(a, P.DropGrant):
            gkey = a.key or k.grant(group)
            # Only that exact grant (its holder's entry is gone): a newer grant under the key stays.
            resp = await self.lead.txn([ops.value_is(gkey, "==", a.raw)], [ops.delete(gkey)])
            return resp.header.revision if resp.succeeded else 0
        if isinstance(a, P.FailWaiter):
            qkey = k.queue_entry(group, a.job)
            failure_val = R.FailureValue(a.token, a.reason, a.node, R.now_ms())
            resp = await self.lead.txn([ops.create_rev(qkey, "==", a.token)],
                                       [ops.put(k.failure(group, a.job), failure_val.dump(), a.lease), ops.delete(qkey)])
            if resp.succeeded:
                self.metrics.swap_failures.inc()
                log.warning("swap_failed", group=group, job=a.job, token=a.token, epoch=epoch, reason=a.reason)
            return resp.header.revision if resp.succeeded else 0
        raise TypeError(f"unknown action {a!r}")

    def record_grant(self, group: str, job: str, token: int, restored: bool, elided: bool, bytes_moved: int,
                     direct: bool = False, shared: bool = False, backfilled: bool = False) -> None:
        """Metrics and the ``grant`` event, for scheduler grants and direct handoffs alike. ``shared``:
        granted beside another holder (a fit group); ``backfilled``: before an earlier waiter."""
        now = time.monotonic()
        tok, seen = self._head_seen.get(group, (token, now))
        self.metrics.grants.inc()
        self.metrics.grant_kinds.labels("shared" if shared else "exclusive").inc()
        if backfilled:
            self.metrics.backfilled.inc()
        self.metrics.handoff.observe(now - seen if tok == token else 0.0)
        if elided:
            self.metrics.elided.inc()
        stok, sstart = self._swap_start.pop(group, (0, now))
        if stok == token:
            self.metrics.swap.observe(now - sstart)
        log.info("grant", group=group, job=job, token=token, epoch=self.lead.epoch,
                 restored=restored, elided=elided, bytes_moved=bytes_moved, direct=direct, shared=shared,
                 backfilled=backfilled)


def _head_waits(gs) -> bool:
    """Someone waits and the last plan wrote nothing: in a fit group, any waiter beside the holders."""
    if gs.parsed is not None and gs.parsed.shared:
        held = gs.holders()
        return any(j not in held for j in gs.queue)
    return not gs.granted() and bool(gs.queue)


def grant_shares(a: P.WriteGrant, gs) -> bool:
    """True if the grant is made beside another holder of the group (counted as a shared grant)."""
    return a.shared and any(j != a.job for j in gs.holders())
