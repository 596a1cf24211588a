"""A fit group's next step, sans-IO: whom to serve beside the holders, and what it weighs.

The rule is lockd/weights.py's (a FIFO weighted semaphore per GPU, backfill that never delays the
head); this module applies it to one group's state as lockd.plan sees it, and hands the chosen
waiter to ``plan.serve`` for its swap and grant, exactly as in an exclusive group, with the
holders protected (never parked: ``holding``) and their room to grow kept (``reserve``):

  1. an exclusive holder (or one of unknown weight) is alone: nobody else until it yields;
  2. the head (the earliest waiter by arrival, or a priority group's; lockd.priority) is served when
     it fits beside the holders (``weights.fits``), first raising the turns token if it overtakes an
     entry by key (a re-keyed head: tokens stay increasing in grant order);
  3. else a later waiter may be *backfilled*, only as a plain grant (nothing to move or freeze) and
     only if ``weights.may_backfill`` holds; its grant first raises the turns token to its own, so
     the head and every waiter below re-key above it (lockd/rekey.py) before it is granted;
  4. else the group waits for holders to yield: exclusive time-slicing of what does not fit.
"""
from __future__ import annotations

import dataclasses

from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.lockd import plan as P
from timeslice.lockd import priority as PR
from timeslice.lockd import weights as W
from timeslice.lockd.index import KV, GroupState, status_of
from timeslice.lockd.occupancy import NodeView
from timeslice.lockd.residency import residency

#: Later waiters looked at for a backfill in one plan (the plan stays cheap with a long queue).
MAX_BACKFILL_LOOKS = 8


def plan_fit(ctx: P.PlanContext, group: GroupState, live: dict[str, tuple[KV, R.GrantValue]],
             turns: PR.Turns) -> list[P.Action]:
    """``live``: job -> (grant kv, grant) of every holder whose grant is current."""
    holders = sorted(live.items(), key=lambda it: it[1][1].token)
    hw = [W.of_grant(g) for _, (_, g) in holders]
    if any(w.exclusive for w in hw):
        return []                                         # alone on its GPUs until it yields
    head, prio = P.pick_head(group, ctx.spec, ctx.nodes, ctx.now_ms, live)
    if head is None or prio is None or not prio.ready:
        return []                                         # idle, or the head re-keys first
    views = _views(ctx)
    caps = W.capacities(v for v in views.values() if v is not None)
    margin = ctx.policy.device_margin_bytes
    rev = max((gkv.mod_revision for gkv, _ in live.values()), default=0)
    jobs = [j for j, _ in holders]
    reserve = {node: W.reserve(hw, node, {j: v.seen(j) or {} for j in jobs}, jobs)
               for node, v in views.items() if v is not None} if holders else None
    head_w = weight(ctx, views, *head)
    if W.fits(head_w, hw, caps, margin):
        if prio.raise_to:
            # Before any intent or grant carries its token: the waiters it overtakes re-key above it.
            return [P.RaiseTurns(prio.raise_to, turns.mod_revision, turns.raised(prio.raise_to))]
        return _stamp(P.serve(ctx, *head, reserve=reserve), head_w, rev, False, turns)
    # A backfill is judged on the room the holders' going will really give back: what is free now plus
    # what they hold, within the capacity (memory nobody admitted, another process's, stays taken).
    room = W.returnable(caps, {(n, g): f for n, v in views.items() if v is not None for g, f in v.free.items()},
                        [{(n, g): b for n, v in views.items() if v is not None for g, b in (v.seen(j) or {}).items()}
                         for j in jobs])
    for job, kv in _later(group, live, head[0], turns)[:MAX_BACKFILL_LOOKS]:
        w = weight(ctx, views, job, kv)
        if not W.may_backfill(head_w, w, hw, room, margin):
            continue
        acts = P.serve(ctx, job, kv, reserve=reserve)
        if len(acts) != 1 or not isinstance(acts[0], P.WriteGrant):
            continue                                      # only a plain grant: no swap of its can hold the head up
        tok = kv.create_revision
        if any(turns.token <= q.create_revision < tok for j, q in group.queue.items() if j != job and j not in live):
            # It overtakes the head (and whoever waits below it) by key: they re-key above it first.
            return [P.RaiseTurns(tok, turns.mod_revision, turns.raised(tok))]
        return _stamp(acts, w, rev, True, turns)
    return []                                             # wait for holders to yield


def weight(ctx: P.PlanContext, views: dict[str, NodeView | None], job: str, kv: KV) -> W.Weight:
    """What ``job``'s grant would weigh, on each of the group's GPUs it uses (lockd.weights)."""
    entry = R.QueueValue.load(kv.value)
    if entry.exclusive:
        return W.WHOLE
    per: dict[W.Slot, int] = {}
    for e in ctx.spec.nodes:
        node = e["node"]
        view = views.get(node)
        if view is None:
            return W.WHOLE                                # no agent: nothing is known of the node
        ns = ctx.nodes.get(node)
        on_node = (job in ctx.node_jobs.get(node, set()) if ctx.node_jobs is not None
                   else node in (ctx.jobs[job].nodes() if job in ctx.jobs else ()))
        where = residency(ns, job, on_node, view.agent)
        snap = status_of(ns, job) if where in ("snapshotted", "partial") else None
        mine = view.group_gpus(e)
        placed = view.known_gpus(job, ctx.jobs.get(job), snap) & mine
        gpus = placed or mine
        if entry.device_bytes_hint <= 0 and entry.peak_bytes <= 0:
            return W.WHOLE                                # nothing declared or measured: the whole device
        seen = dict(view.seen(job) or {}) if where in ("running", "partial", "unknown") else {}
        for g, b in ((view.by_index(snap.gpu_bytes) or {}) if snap is not None and snap.gpu_bytes else {}).items():
            seen[g] = max(seen.get(g, 0), b)
        residue = FP.spread(snap.residue_bytes, gpus) if snap is not None else None
        for g in gpus:
            # The footprint rule (lockd.footprints): max(declared, observed, seen - context) + context +
            # margin. A job whose placement is not known yet may land on any of the group's GPUs: its
            # per-node figures count whole on each of them.
            fp = FP.footprint(gpus if placed else {g}, hint=entry.device_bytes_hint, peak=entry.peak_bytes,
                              context=entry.context_bytes, seen={k: v for k, v in seen.items() if k in mine},
                              residue=residue, capacity=view.total)
            per[(node, g)] = FP.admitted(fp, g, ctx.policy.footprint)
    return W.Weight(per)


def _views(ctx: P.PlanContext) -> dict[str, NodeView | None]:
    out: dict[str, NodeView | None] = {}
    for node in ctx.spec.node_names():
        ns = ctx.nodes.get(node)
        agent = R.AgentValue.load(ns.agent.value) if ns is not None and ns.agent is not None else None
        out[node] = NodeView.of(node, agent) if agent is not None else None
    return out


def _later(group: GroupState, live: dict, head: str, turns: PR.Turns) -> list[tuple[str, KV]]:
    """The waiters behind the head, by arrival: those that may be backfilled (not holders, not
    below the turns token: an entry that must re-key first is never granted under its key)."""
    ws = [(j, kv) for j, kv in group.queue.items()
          if j != head and j not in live and kv.create_revision >= turns.token]
    return sorted(ws, key=lambda it: R.QueueValue.load(it[1].value).arrival(it[1].create_revision))


def _stamp(acts: list[P.Action], w: W.Weight, rev: int, backfilled: bool, turns: PR.Turns) -> list[P.Action]:
    """The grant of a fit group carries what it weighs and what it was planned on: the grants, and the
    turns key (a backfill's raise since, with the moves it starts, makes the plan stale; a priority
    group's grant counts itself there already)."""
    return [dataclasses.replace(a, shared=True, exclusive=w.exclusive, backfilled=backfilled,
                                footprint=w.footprint(), holders_rev=rev,
                                turns_rev=a.turns_rev if a.turns_rev >= 0 else turns.mod_revision)
            if isinstance(a, P.WriteGrant) else a for a in acts]
