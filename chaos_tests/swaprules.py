"""Checker rules about the jobs' device memory across swaps, over the history.

They judge what the jobs themselves report (their device's bytes and regions, see
``device.py`` and ``coopdevice.py``) and what the agents wrote in etcd (``observer.py``):

device        Once a process filled its device memory (``device_fill``), every critical
              section it enters checks those bytes (a ``data_check`` with the section's
              token) before it ends: no grant goes unverified. (Whether the bytes were
              intact is the ``data`` rule.) A section cut short (``abandoned``, ``error``)
              is not judged, nor are the sections of a process after its first failed
              check: that failure is a violation already.
memory-back   No grant to a job whose memory is not back. The job says so itself, two
              ways: its ``memory`` report at the start of a section (``back: false``:
              a cooperative region still released, a checkpointed process not restored),
              and its cooperative worker's own account of what the agent asked of it
              (``coop_paused`` / ``coop_resumed``, per process): a ``granted`` while some
              region is paused and not resumed is a violation.
parked-orphan No job stays parked (the agent's status: snapshotting, snapshotted,
              restoring, frozen) on a node while it has no live session (no session key
              in etcd) for longer than ``bound`` seconds after that began, or after the
              last fault that was active meanwhile healed. An orphan left at the end of a
              history that ran past its deadline is a violation too.

Histories without the events a rule needs are not judged by it.
"""
from __future__ import annotations

import math

from chaos_tests.crossgroup import PARKED

_END = math.inf


def check_swaps(events: list[dict], report, at, orphan_bound_s: float) -> None:
    """Append ``[device]``, ``[memory-back]`` and ``[parked-orphan]`` violations; ``events`` sorted by t."""
    _check_device(events, report, at)
    _check_memory_back(events, report, at)
    _check_orphans(events, report, at, orphan_bound_s)


def faults_of(events: list[dict]) -> list[tuple[int, int, str]]:
    """(start, end, what) of every fault the test recorded; one never healed is instantaneous."""
    started: dict = {}
    for e in events:
        if e["ev"] == "fault":
            started[e.get("fault_id", len(started))] = [e["t"], e["t"], e.get("what", "?")]
        elif e["ev"] == "heal" and e.get("fault_id") in started:
            started[e["fault_id"]][1] = e["t"]
    return [tuple(f) for f in started.values()]  # type: ignore[misc]


def deadline(start: int, bound_ns: int, faults: list[tuple[int, int, str]]) -> int:
    """``start + bound``, pushed to ``heal + bound`` by every fault active before that deadline."""
    d = start + bound_ns
    changed = True
    while changed:
        changed = False
        for f0, f1, _ in faults:
            if f0 <= d and f1 >= start and f1 + bound_ns > d:
                d, changed = f1 + bound_ns, True
    return d


def _check_device(events: list[dict], report, at) -> None:
    filled: set[int] = set()
    failed: set[int] = set()
    open_: dict[str, list] = {}          # job -> [pid, group, token, start, checked]
    for e in events:
        ev, job, pid = e["ev"], e.get("job"), e.get("pid")
        if ev == "device_fill":
            filled.add(pid)
        elif ev == "data_check" and e.get("token") is not None:
            if not e.get("ok"):
                failed.add(pid)
            cur = open_.get(job)
            if cur is not None and cur[0] == pid and cur[2] == e.get("token"):
                cur[4] = True
        elif ev == "cs_start":
            open_.pop(job, None)
            if pid in filled and pid not in failed:
                open_[job] = [pid, e.get("group"), e.get("token"), e["t"], False]
        elif ev == "cs_end":
            cur = open_.pop(job, None)
            if cur is not None and not cur[4] and cur[0] == pid and pid not in failed:
                report.violations.append(
                    f"[device] {cur[1]}: {job} (pid {pid}) held token {cur[2]} from {at(cur[3])} to "
                    f"{at(e['t'])} without checking its device bytes")
        elif ev in ("abandoned", "error"):
            open_.pop(job, None)


def _check_memory_back(events: list[dict], report, at) -> None:
    seen: set[tuple] = set()

    def flag(e: dict, why: str) -> None:
        key = (e.get("job"), e.get("token"))
        if key not in seen:
            seen.add(key)
            report.violations.append(f"[memory-back] {e.get('group')}: {e.get('job')} granted token "
                                     f"{e.get('token')} at {at(e['t'])} {why}")

    paused: dict[int, dict[str, int]] = {}        # pid -> tag -> when its pause was reported
    for e in events:
        ev, pid = e["ev"], e.get("pid")
        if ev == "coop_paused":
            for t in e.get("tags") or ():
                paused.setdefault(pid, {}).setdefault(t, e["t"])
        elif ev == "coop_resumed":
            for t in e.get("tags") or ():
                paused.get(pid, {}).pop(t, None)
        elif ev == "granted" and paused.get(pid):
            still = paused[pid]
            flag(e, f"while its regions {sorted(still)} were paused (since "
                    f"{at(min(still.values()))}) and not resumed")
        elif ev == "memory" and e.get("back") is False:
            flag(e, f"while its memory was not back ({e.get('backend', '?')}): {e.get('detail', '')}")


def _check_orphans(events: list[dict], report, at, bound_s: float) -> None:
    if not any(e["ev"] in ("session_put", "session_end") for e in events):
        return
    end_t = events[-1]["t"]
    bound = int(bound_s * 1e9)
    faults = faults_of(events)
    sessions: set[str] = set()
    parked: dict[tuple[str, str], str] = {}       # (node, job) -> state
    orphan_since: dict[tuple[str, str], int] = {}

    def judge(key: tuple[str, str], t_end: float) -> None:
        since = orphan_since.pop(key, None)
        if since is None:
            return
        due = deadline(since, bound, faults)
        if t_end > due and (t_end != _END or end_t > due):
            until = f"until {at(t_end)}" if t_end != _END else "to the end of the history"
            report.violations.append(
                f"[parked-orphan] {key[1]}: {parked.get(key, '?')} on {key[0]} without a live session from "
                f"{at(since)} {until}, past its deadline {at(due)} ({bound_s:g}s after that or after "
                "the last fault active meanwhile healed)")

    def recheck(key: tuple[str, str], t: int) -> None:
        orphaned = key in parked and key[1] not in sessions
        if orphaned and key not in orphan_since:
            orphan_since[key] = t
        elif not orphaned and key in orphan_since:
            judge(key, t)

    for e in events:
        ev, job = e["ev"], e.get("job")
        if ev == "session_put":
            sessions.add(job)
        elif ev == "session_end":
            sessions.discard(job)
        elif ev == "parked" and e.get("state") in PARKED:
            parked[(e.get("node"), job)] = e.get("state")
        elif ev == "unparked":
            key = (e.get("node"), job)
            judge(key, e["t"])
            parked.pop(key, None)
            continue
        else:
            continue
        for key in [k for k in parked if k[1] == job]:
            recheck(key, e["t"])
    for key in list(orphan_since):
        judge(key, _END)
