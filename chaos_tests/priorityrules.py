"""The checker's rules for a group with priority classes (lockd/priority.py), from the history alone.

Such a group is not FIFO across classes, so fifo (1) of checker.py (tokens follow request order)
does not apply to it: an overtaken waiter is granted later under a fresh key. Instead:

fifo-class  Within one class, if A's ``enqueued`` precedes B's ``acquire_req`` and both are
            granted, A is granted first.
overtake    A waiter granted after waiting is overtaken by at most K (the group's max_overtakes)
            grants of requests made after it joined (``enqueued``) and granted before it.

token-order (grant tokens strictly increase in grant order) and every other rule still hold.
"""
from __future__ import annotations

from typing import Any


def check_priority_group(group: str, attempts: list[Any], bound: int, report: Any, at) -> None:
    """``attempts``: checker.py's, with job, req_t, enq_t, grant_t, priority, outcome."""
    granted = sorted((a for a in attempts if a.outcome == "granted" and a.grant_t is not None),
                     key=lambda a: a.grant_t)
    by_class: dict[int, list[Any]] = {}
    for a in granted:
        by_class.setdefault(a.priority, []).append(a)
    for cls, members in by_class.items():
        # In grant order, from the last: the earliest join among those granted after B. If that A
        # joined before B asked, B overtook A within their class.
        earliest = None
        for b in reversed(members):
            a = earliest
            if a is not None and a.enq_t < b.req_t:
                report.violations.append(
                    f"[fifo-class] {group}: {b.job} (class {cls}) asked at {at(b.req_t)}, after {a.job} "
                    f"joined at {at(a.enq_t)}, yet was granted first ({at(b.grant_t)} < {at(a.grant_t)})")
            if b.enq_t is not None and (earliest is None or b.enq_t < earliest.enq_t):
                earliest = b
    for a in granted:
        if a.enq_t is None:
            continue
        later = [b for b in granted if b is not a and b.req_t > a.enq_t and a.enq_t < b.grant_t < a.grant_t]
        if len(later) > bound:
            report.violations.append(
                f"[overtake] {group}: {a.job} (class {a.priority}) joined at {at(a.enq_t)} and was granted at "
                f"{at(a.grant_t)} after {len(later)} later requests were granted (bound {bound}): "
                + ", ".join(b.job for b in later[:8]))
