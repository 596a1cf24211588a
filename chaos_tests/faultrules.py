"""Checker rules about the lock's behaviour around the faults themselves, over the history.

The test records each fault it injects (``fault``: fault_id, what, and ``no_quorum: true``
when it takes an etcd majority away) and when it healed (``heal``: fault_id).

recovery   Liveness: once a fault heals, each group that anyone asks for is granted again
           within ``bound`` seconds of the heal (or of the first request after it), the
           deadline pushed by every other fault active before it. Figures per fault too
           (``Report.recoveries``: heal to the next grant in any group, and to the next grant
           of the slowest group that was asked for; None: never). This bound is
           generous on purpose (seconds of failover and re-election, not minutes of a
           starved queue); it is no timing assertion on a fast path.
heal       The first grant after every heal within ``HEAL_BOUND_S`` (10 s): each group that anyone
           asks for is granted within 10 s of the heal (or of the first request after it), the
           deadline pushed by every other fault active before it. The same measure as
           ``recovery``, at the bound the lock promises rather than a generous one.
quorum     While an etcd majority is gone, no new grant is made: a (group, token) first
           returned more than ``QUORUM_SLACK_S`` after the majority went and before it came
           back is a violation (a grant written just before may reach its client late).
status     No call fails with INTERNAL: an etcd hiccup is a transient condition, for which
           the lock promises UNAVAILABLE (``error`` events carry the gRPC ``code``).
"""
from __future__ import annotations

from chaos_tests.swaprules import deadline, faults_of

#: A grant written just before the quorum went may reach its client this much later.
QUORUM_SLACK_S = 2.0
#: The first grant after a heal comes within this (README "Fault tolerance").
HEAL_BOUND_S = 10.0


def check_faults(events: list[dict], report, at, recovery_bound_s: float,
                 heal_bound_s: float | None = HEAL_BOUND_S) -> None:
    """Append ``[recovery]``, ``[heal]`` (unless ``heal_bound_s`` is None), ``[quorum]`` and ``[status]``
    violations; fill ``report.recoveries``."""
    _check_recovery(events, report, at, recovery_bound_s)
    if heal_bound_s is not None:
        _check_recovery(events, report, at, heal_bound_s, label="heal", figures=False)
    _check_quorum(events, report, at)
    for e in events:
        if e["ev"] == "error" and e.get("code") == "INTERNAL":
            report.violations.append(f"[status] {e.get('group')}: {e.get('job')} at {at(e['t'])} failed with "
                                     f"INTERNAL, not a transient status: {str(e.get('message', ''))[:200]}")


def _check_recovery(events: list[dict], report, at, bound_s: float, label: str = "recovery",
                    figures: bool = True) -> None:
    faults = faults_of(events)
    if not faults:
        return
    end_t = events[-1]["t"]
    bound = int(bound_s * 1e9)
    grants: dict[str, list[int]] = {}
    asks: dict[str, list[list]] = {}             # group -> [req_t, end_t]
    open_: dict[tuple, list] = {}
    for e in events:
        ev, key = e["ev"], (e.get("group"), e.get("job"))
        if ev == "acquire_req":
            open_[key] = [e["t"], end_t + 1]
            asks.setdefault(key[0], []).append(open_[key])
        elif ev in ("granted", "error", "abandoned") and key in open_:
            open_.pop(key)[1] = e["t"]
        if ev == "granted":
            grants.setdefault(key[0], []).append(e["t"])
    all_grants = sorted(t for ts in grants.values() for t in ts)
    for _f0, f1, what in faults:
        slowest: int | None = f1                  # the latest first-grant-after-heal of a group asked for
        for group, reqs in asks.items():
            demand = [max(r0, f1) for r0, r1 in reqs if r1 > f1]
            if not demand:
                continue
            due = deadline(min(demand), bound, faults)
            got = next((t for t in grants.get(group, ()) if t > f1), None)
            slowest = None if slowest is None or got is None else max(slowest, got)
            if (got is None and end_t > due) or (got is not None and got > due):
                late = f"only at {at(got)}" if got is not None else "never"
                report.violations.append(
                    f"[{label}] {group}: after '{what}' healed at {at(f1)}, asked for from "
                    f"{at(min(demand))}, granted {late}: past {bound_s:g}s")
        first = next((t for t in all_grants if t > f1), None)
        if figures:
            report.recoveries.append((what, _secs(first, f1), _secs(slowest, f1)))


def _secs(t: int | None, since: int) -> float | None:
    return round((t - since) / 1e9, 3) if t is not None else None


def _check_quorum(events: list[dict], report, at) -> None:
    gone = [(e["t"], e.get("fault_id")) for e in events if e["ev"] == "fault" and e.get("no_quorum")]
    if not gone:
        return
    back = {e.get("fault_id"): e["t"] for e in events if e["ev"] == "heal"}
    windows = [(t0 + int(QUORUM_SLACK_S * 1e9), back.get(fid, events[-1]["t"])) for t0, fid in gone]
    seen: set[tuple] = set()
    for e in events:
        if e["ev"] != "granted":
            continue
        key = (e.get("group"), e.get("token"))
        if key in seen:
            continue
        seen.add(key)
        if any(lo < e["t"] < hi for lo, hi in windows):
            report.violations.append(f"[quorum] {e.get('group')}: {e.get('job')} granted token {e.get('token')} "
                                     f"at {at(e['t'])} while etcd had no majority")
