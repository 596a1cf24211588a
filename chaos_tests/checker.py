"""The independent judge of a chaos run: a pure function over the merged history.

It trusts nothing but the events (see ``history.py``) and their monotonic times,
and checks, per group:

mutex       No two critical sections of different jobs overlap in time. A
            section runs from ``cs_start`` to the job's ``cs_end`` (or to the
            ``error``/``abandoned``/``yield`` that cut it short; to the end of
            the history if nothing did). A section the fence refused
            (``fence_reject`` inside it) only counts up to its last accepted
            operation: the fence stopped it, which is the fence doing its job.
            So chaos clients should end each section with a fenced operation.
token-order Grant tokens strictly increase in grant-time order. This is also
            the overtaking rule: a waiter with a smaller token that is granted
            after a larger token was granted has been overtaken. A waiter that
            ends in ``error``/``abandoned`` is not counted as overtaken: its key
            may have been removed rightly (lease expiry) before its client noticed.
            A hold kept is no new grant: a job whose Yield of token T failed
            (``error`` with T: an etcd majority loss outlasted the call) still
            holds T, and its next Acquire returns T again; that is judged as the
            same grant, as long as the group's last grant is still the job's T.
fifo        (1) If A's ``enqueued`` event precedes B's ``acquire_req``, A's token
            is smaller than B's: tokens follow real request order. (2) With
            ``expected_order``, the grants of the listed jobs, in time order,
            are exactly that list (per group, or the same list for every group).
priority    Groups named in ``priorities`` (group -> its max_overtakes K) replace
            fifo (1) by: FIFO within a class, and no waiter overtaken by more
            than K later requests (priorityrules.py). token-order still holds.
fit         Groups named in ``fit`` (group -> its GPUs' capacities and margin), whose holders
            run side by side, replace mutex, token-order and fifo (1) by fitrules.py's rules:
            the sections in progress fit on each GPU and an exclusive one is alone, each job's
            tokens increase, only a backfill goes before an earlier waiter.
lost-waiter Every ``acquire_req`` ends in ``granted``, ``error`` or ``abandoned``
            before the job's next ``acquire_req`` and before the history ends.
stale-token A ``cs_start`` carries the token of the grant the job holds; the
            fence never accepts a token older than one it accepted before.
data        Every ``data_check`` has ``ok: true``.
protocol    Events come in a possible order (no grant without a request, no
            ``cs_end`` without ``cs_start``, no section left open).
ghost,      With an observer's ``grant_put``/``grant_end`` and library clients'
session-loss ``session_lost`` events (claims.py): every grant is returned to a
            live caller or released within ``ghost_bound_s``; no job is told its
            session is lost while its lease is alive.
cross-group With an observer's ``group_spec`` and ``parked``/``unparked`` events
            (crossgroup.py): a job holding any group is never snapshotted,
            frozen or being moved on that group's devices.
device,     With jobs on a simulated device (swaprules.py): every grant's section
memory-back, checks the job's device bytes; no job is granted while its memory is
parked-orphan not back (a cooperative region released, a checkpointed process not
            restored), from the jobs' own reports; no job stays parked on a node
            without a live session past ``orphan_bound_s`` (after the last fault
            active meanwhile healed).
recovery,   With the test's ``fault``/``heal`` events (faultrules.py): each group
heal,       asked for is granted again within ``recovery_bound_s`` of a heal, and
quorum,     within ``heal_bound_s`` (10 s); no new grant while etcd has no majority;
status      no call fails with INTERNAL.

Fence rejections are figures, not violations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from chaos_tests.claims import check_claims
from chaos_tests.crossgroup import check_cross_group
from chaos_tests.faultrules import HEAL_BOUND_S, check_faults
from chaos_tests.fitrules import check_fit_group
from chaos_tests.priorityrules import check_priority_group
from chaos_tests.swaprules import check_swaps

_OPEN = math.inf


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    grants: int = 0
    groups: int = 0
    jobs: int = 0
    acquires: int = 0
    critical_sections: int = 0
    errors: int = 0
    abandoned: int = 0
    fence_rejections: int = 0
    fenced_sections: int = 0
    max_grant_gap_s: float = 0.0
    max_wait_s: float = 0.0
    # (fault, s from its heal to the next grant in any group, ... in the slowest group asked for), None: never
    recoveries: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def of_kind(self, kind: str) -> list[str]:
        """Violations of one rule, e.g. ``of_kind("mutex")``."""
        return [v for v in self.violations if v.startswith(f"[{kind}]")]


@dataclass
class _Attempt:
    job: str
    req_t: int
    token: int | None = None
    enq_t: int | None = None
    outcome: str | None = None  # granted | error | abandoned
    priority: int = 0           # the class asked for (``acquire_req``'s ``priority``)
    grant_t: int | None = None
    kept: bool = False          # answered with the hold the job kept (its Yield failed): no new grant
    backfilled: bool = False    # a fit group's grant made before an earlier waiter (``granted``'s flag)


@dataclass
class _Section:
    job: str
    token: int
    start: int
    end: float = _OPEN
    last_ok: int | None = None
    rejected: bool = False

    def effective(self) -> tuple[int, float] | None:
        if not self.rejected:
            return self.start, self.end
        return (self.start, self.last_ok) if self.last_ok is not None else None


@dataclass
class _Group:
    attempts: list[_Attempt] = field(default_factory=list)
    grants: list[tuple[int, int, str]] = field(default_factory=list)  # (t, token, job)
    sections: list[_Section] = field(default_factory=list)
    fence_ok: list[tuple[int, int, str]] = field(default_factory=list)
    # (job, token) -> (footprint {"<node>/<gpu>": bytes}, exclusive, backfilled), from ``granted`` (fit groups)
    grant_facts: dict[tuple[str, int], tuple[dict, bool, bool]] = field(default_factory=dict)
    # (job, token) -> when the observer saw the grant deleted (``grant_end``): a holder's section counts
    # while its grant exists (fitrules.py); one paused past its lease runs on, and the device stops it
    grant_ends: dict[tuple[str, int], int] = field(default_factory=dict)
    # (job, token) -> etcd's revision of the grant's first write / of its deletion, where the observer
    # recorded them: its times are delivery times, late when its thread or watch lagged, so which grant
    # the lock ended before writing the next is read from these (fitrules.py)
    grant_put_revs: dict[tuple[str, int], int] = field(default_factory=dict)
    grant_end_revs: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class _JobState:
    waiting: _Attempt | None = None
    held: int | None = None
    section: _Section | None = None
    kept: int | None = None     # the token of a hold whose Yield failed (still the job's, as far as it knows)


def check(history_events: list[dict], expected_order=None, ghost_bound_s: float = 10.0,
          orphan_bound_s: float = 10.0, recovery_bound_s: float = 30.0,
          priorities: dict[str, int] | None = None, heal_bound_s: float | None = HEAL_BOUND_S,
          fit: dict[str, dict] | None = None) -> Report:
    """Judge a history (any order); ``expected_order``: list of jobs, or {group: list};
    ``priorities``: the groups with priority classes, each with its max_overtakes;
    ``fit``: the groups with sharing "fit", each with {"capacity": {"<node>/<gpu>": bytes}, "margin"}
    (fitrules.py);
    ``ghost_bound_s``: how soon a grant nobody claimed must be released (claims.py);
    ``orphan_bound_s``: how long a job may stay parked without a session (swaprules.py);
    ``recovery_bound_s``: how soon after a heal each group is granted again (faultrules.py);
    ``heal_bound_s``: the same at the bound the lock promises (None: not judged)."""
    events = sorted(history_events, key=lambda e: e["t"])
    report = Report()
    if not events:
        return report
    # Times are printed from the scenario's start (its ``start`` event: where its figures count
    # from), else from the first event.
    t0 = next((e["t"] for e in events if e["ev"] == "start"), events[0]["t"])

    def at(t: float) -> str:
        return f"{(t - t0) / 1e9:+.3f}s"

    groups: dict[str, _Group] = {}
    states: dict[tuple, _JobState] = {}
    for e in events:
        _step(e, groups.setdefault(e.get("group"), _Group()),
              states.setdefault((e.get("group"), e.get("job")), _JobState()), report, at)
    for (group, job), st in states.items():
        if st.waiting is not None:
            report.violations.append(f"[lost-waiter] {group}: acquire by {job} at "
                                     f"{at(st.waiting.req_t)} never granted nor failed")
        if st.section is not None:
            report.violations.append(f"[protocol] {group}: section of {job} from "
                                     f"{at(st.section.start)} never ended")
    # Groups nobody asked for (e.g. events without a group) have nothing to judge.
    active = {group: g for group, g in groups.items() if g.attempts or g.grants}
    for group, g in active.items():
        bound = (priorities or {}).get(group)
        shared = (fit or {}).get(group)
        _check_group(group, g, report, at, _expected_for(expected_order, group),
                     fifo=bound is None and shared is None, exclusive=shared is None)
        if bound is not None:
            check_priority_group(group, [a for a in g.attempts if not a.kept], bound, report, at)
        if shared is not None:
            check_fit_group(group, g, shared, report, at)
    check_claims(events, report, at, ghost_bound_s)
    check_cross_group(events, report, at)
    check_swaps(events, report, at, orphan_bound_s)
    check_faults(events, report, at, recovery_bound_s, heal_bound_s)
    report.groups = len(active)
    report.jobs = len({job for (_, job), _ in states.items() if job is not None})
    return report


def _step(e: dict, g: _Group, st: _JobState, report: Report, at) -> None:
    """Advance one (group, job) through one event; protocol breaches become violations."""
    ev, t, job, token, group = e["ev"], e["t"], e.get("job"), e.get("token"), e.get("group")
    where = f"{group}: {job} at {at(t)}"
    if ev in ("acquire_req", "granted", "yield", "error", "abandoned") and st.section:
        if ev not in ("error", "abandoned"):
            report.violations.append(f"[protocol] {where}: {ev} inside a critical section")
        st.section.end = t
        st.section = None
    if ev == "acquire_req":
        if st.waiting is not None:
            report.violations.append(f"[lost-waiter] {where}: new acquire while the one "
                                     f"from {at(st.waiting.req_t)} is unresolved")
        st.waiting = _Attempt(job, t, priority=int(e.get("priority", 0)))
        g.attempts.append(st.waiting)
        report.acquires += 1
    elif ev == "enqueued" and st.waiting is not None:
        st.waiting.token, st.waiting.enq_t = token, t
    elif ev == "granted":
        # The hold the job kept when its Yield failed, given back: the same grant, if nobody's came since.
        kept = st.kept is not None and token == st.kept and bool(g.grants) and g.grants[-1][1:] == (token, job)
        if st.waiting is None:
            report.violations.append(f"[protocol] {where}: granted without acquire_req")
        else:
            report.max_wait_s = max(report.max_wait_s, (t - st.waiting.req_t) / 1e9)
            st.waiting.token, st.waiting.outcome, st.waiting.grant_t = token, "granted", t
            st.waiting.kept = kept
            st.waiting.backfilled = bool(e.get("backfilled"))
            st.waiting = None
        if not kept:
            g.grants.append((t, token, job))
            g.grant_facts[(job, token)] = (dict(e.get("footprint") or {}), bool(e.get("exclusive")),
                                           bool(e.get("backfilled")))
        st.held, st.kept = token, None
        report.grants += 1
    elif ev == "cs_start":
        if st.held is None or token != st.held:
            report.violations.append(f"[stale-token] {where}: cs_start with token {token} "
                                     f"but the job holds {st.held}")
        if st.section is not None:
            report.violations.append(f"[protocol] {where}: cs_start inside a section")
        st.section = _Section(job, token, t)
        g.sections.append(st.section)
        report.critical_sections += 1
    elif ev == "cs_end":
        if st.section is None or st.section.token != token:
            report.violations.append(f"[protocol] {where}: cs_end without matching cs_start")
        else:
            st.section.end, st.section = t, None
    elif ev == "fence_ok":
        g.fence_ok.append((t, token, job))
        if st.section is not None and st.section.token == token:
            st.section.last_ok = t
    elif ev == "fence_reject":
        report.fence_rejections += 1
        if st.section is not None and not st.section.rejected:
            st.section.rejected = True
            report.fenced_sections += 1
    elif ev in ("yield", "error", "abandoned"):
        if ev == "yield" and st.held != token:
            report.violations.append(f"[protocol] {where}: yield of token {token} "
                                     f"but the job holds {st.held}")
        if st.waiting is not None and ev != "yield":
            st.waiting.outcome, st.waiting = ev, None
        if ev == "yield":
            st.kept = None
        elif st.held is not None and token == st.held:
            st.kept = token             # its Yield (or section) failed: the hold may still be the job's
        st.held = None
        report.errors += ev == "error"
        report.abandoned += ev == "abandoned"
    elif ev == "grant_end" and token is not None:
        g.grant_ends.setdefault((job, token), t)
        if e.get("rev"):
            g.grant_end_revs.setdefault((job, token), e["rev"])
    elif ev == "grant_put" and token is not None and e.get("rev"):
        g.grant_put_revs.setdefault((job, token), e["rev"])
    elif ev == "data_check" and not e.get("ok"):
        report.violations.append(f"[data] {where}: {e.get('detail', 'data check failed')}")


def _check_group(group, g: _Group, report: Report, at, expected: list[str] | None, fifo: bool = True,
                 exclusive: bool = True) -> None:
    """``exclusive``: one holder at a time (mutex and token-order by grant time); a fit group's
    holders share (fitrules.py judges it instead)."""
    # mutex: sweep sections by start, comparing with the one reaching furthest.
    spans = sorted(((*span, s) for s in g.sections if (span := s.effective())),
                   key=lambda x: x[0]) if exclusive else []
    reach = None
    for start, end, s in spans:
        if reach and start < reach[1] and s.job != reach[2].job:
            report.violations.append(
                f"[mutex] {group}: {s.job} (token {s.token}) entered at {at(start)} while "
                f"{reach[2].job} (token {reach[2].token}) was inside since {at(reach[0])}")
        if reach is None or end > reach[1]:
            reach = (start, end, s)
    # token-order: strictly increasing in grant order.
    for (t1, k1, j1), (t2, k2, j2) in zip(g.grants, g.grants[1:]):
        if k2 <= k1 and exclusive:
            report.violations.append(
                f"[token-order] {group}: {j2} granted token {k2} at {at(t2)} after {j1} "
                f"got token {k1} at {at(t1)}: {j2} was overtaken or tokens went back")
        report.max_grant_gap_s = max(report.max_grant_gap_s, (t2 - t1) / 1e9)
    # fifo (1): tokens follow real request order.
    queued = sorted((a for a in g.attempts if a.enq_t is not None), key=lambda a: a.enq_t)
    first: _Attempt | None = None  # the largest-token waiter queued so far
    i = 0
    for b in sorted((a for a in g.attempts if a.token is not None and fifo and not a.kept), key=lambda a: a.req_t):
        while i < len(queued) and queued[i].enq_t < b.req_t:
            if first is None or queued[i].token > first.token:
                first = queued[i]
            i += 1
        if first is not None and b.token <= first.token:
            report.violations.append(
                f"[fifo] {group}: {b.job} asked at {at(b.req_t)}, after {first.job} was "
                f"queued with token {first.token}, yet got token {b.token}")
    # fifo (2): the order the test arranged.
    if expected is not None:
        wanted = set(expected)
        got = [job for _, _, job in g.grants if job in wanted]
        if got != list(expected):
            report.violations.append(f"[fifo] {group}: grant order {got}, expected {expected}")
    # stale-token: the fence never goes back (a fit group's holders share: one fence per job there).
    best: dict[str | None, tuple[int, str]] = {}
    for t, token, job in g.fence_ok:
        k = None if exclusive else job
        if k in best and token < best[k][0]:
            report.violations.append(f"[stale-token] {group}: fence accepted token {token} of "
                                     f"{job} at {at(t)} after token {best[k][0]} of {best[k][1]}")
        if k not in best or token > best[k][0]:
            best[k] = (token, job)


def _expected_for(expected_order, group) -> list[str] | None:
    if isinstance(expected_order, dict):
        return expected_order.get(group)
    return expected_order
