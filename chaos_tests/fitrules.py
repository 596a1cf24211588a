"""The checker's rules for a group with sharing "fit" (lockd/weights.py), from the history alone.

A fit group's holders run side by side, so checker.py's mutex does not apply to it, and neither does
its token order by grant time (two grants a moment apart reach their clients in either order; the
order of the grants themselves is judged from etcd's revision order, holders.py) nor its fifo (1)
(a waiter overtaken by a backfill is granted later under a fresh key). Instead, per fit group, with
its GPUs' capacities and the planner's margin:

fit         At every moment the critical sections in progress weigh, on each GPU, at most its
            capacity less the margin (a section weighs what its grant's ``footprint`` says), and a
            section whose grant weighs the whole device (``exclusive``, or no footprint) overlaps no
            other job's section. A section counts while its grant exists: up to the observer's
            ``grant_end`` of it when one was seen (a holder paused past its lease runs on after its
            grant expired; the device exclusion stops such a process, not the lock). The observer's
            times are delivery times, late when its thread lags: where it recorded revisions, a
            section whose grant etcd deleted before the other's grant was written does not count.
token-job   Each job's grant tokens strictly increase (its next entry is created after its last).
fifo-fit    If A was queued (``enqueued``) before B asked (``acquire_req``), both were granted, and
            B's grant was not ``backfilled``, A's grant token is below B's: only a backfill goes
            before an earlier waiter (tokens increase in grant order, so a smaller token is an
            earlier grant).
starve      A waiter is overtaken only by backfills, and never by more than ``max_backfills`` of
            them (None: any number; the backfill rule never delays the head, so the count is a
            figure, not a bound, unless a scenario sets one).

lost-waiter, stale-token (a job's own), protocol and the rules of the other modules still hold.
"""
from __future__ import annotations

from itertools import pairwise
from typing import Any


def _ended_before(g: Any, o: Any, s: Any) -> bool:
    """Whether etcd's order proves ``o``'s grant was deleted before ``s``'s was written (the observer's
    revisions): then they never held together, however late the observer's thread told the delete."""
    end, put = g.grant_end_revs.get((o.job, o.token)), g.grant_put_revs.get((s.job, s.token))
    return end is not None and put is not None and end < put


def check_fit_group(group: str, g: Any, spec: dict, report: Any, at) -> None:
    """``g``: checker.py's _Group (attempts, sections, grant facts); ``spec``: {"capacity": {"<node>/<gpu>":
    bytes}, "margin": bytes, "max_backfills": int | None}."""
    caps, margin = dict(spec.get("capacity", {})), int(spec.get("margin", 0))
    facts = g.grant_facts                      # (job, token) -> (footprint, exclusive, backfilled)
    # A section counts while its grant exists: up to the observer's ``grant_end`` of it, if seen (a holder
    # paused past its lease runs on after its grant expired; stopping it is the device's job).
    spans = sorted(((span[0], min(span[1], g.grant_ends.get((s.job, s.token), span[1])), s)
                    for s in g.sections if (span := s.effective())), key=lambda x: x[0])
    for i, (start, _, s) in enumerate(spans):
        fp, excl, _ = facts.get((s.job, s.token), ({}, True, False))
        inside = [(o, facts.get((o.job, o.token), ({}, True, False))) for (st, en, o) in spans[:i]
                  if en > start and o.job != s.job and not _ended_before(g, o, s)]
        if not inside:
            continue
        whole = excl or not fp
        others = [o for o, (ofp, oex, _) in inside if oex or not ofp]
        if whole or others:
            who = s if whole else others[0]
            report.violations.append(
                f"[fit] {group}: {s.job} (token {s.token}) entered at {at(start)} beside "
                f"{', '.join(o.job for o, _ in inside)}, while {who.job} (token {who.token}) weighs the whole device")
            continue
        load: dict[str, int] = dict(fp)
        for _, (ofp, _, _) in inside:
            for slot, b in ofp.items():
                load[slot] = load.get(slot, 0) + int(b)
        for slot, b in sorted(load.items()):
            cap = caps.get(slot)
            if cap is None or b > cap - margin:
                report.violations.append(
                    f"[fit] {group}: {s.job} (token {s.token}) entered at {at(start)} beside "
                    f"{', '.join(o.job for o, _ in inside)}: {b} bytes admitted on {slot}, capacity "
                    f"{cap if cap is not None else 'unknown'} less margin {margin}")
    by_job: dict[str, list[tuple[int, int]]] = {}
    for t, token, job in g.grants:
        by_job.setdefault(job, []).append((t, token))
    for job, grants in by_job.items():
        for (t1, k1), (t2, k2) in pairwise(grants):
            if k2 <= k1:
                report.violations.append(f"[token-job] {group}: {job} granted token {k2} at {at(t2)} after "
                                         f"its token {k1} at {at(t1)}")
    granted = [a for a in g.attempts if a.outcome == "granted" and a.token is not None]
    bound = spec.get("max_backfills")
    for b in granted:
        if b.backfilled:
            continue
        for a in granted:
            if a is not b and a.enq_t is not None and a.enq_t < b.req_t and a.token > b.token:
                report.violations.append(
                    f"[fifo-fit] {group}: {b.job} asked at {at(b.req_t)}, after {a.job} was queued at "
                    f"{at(a.enq_t)}, and was granted first (token {b.token} < {a.token}) without a backfill")
    if bound is not None:
        for a in granted:
            if a.enq_t is None:
                continue
            past = [b for b in granted if b.backfilled and b.req_t > a.enq_t and b.token < a.token]
            if len(past) > bound:
                report.violations.append(f"[starve] {group}: {a.job} queued at {at(a.enq_t)} was overtaken "
                                         f"by {len(past)} backfills (bound {bound})")
