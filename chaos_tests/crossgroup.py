"""The cross-group grant invariant, over the history: a job holding any group is never
parked (snapshotted, frozen, or being moved) on that group's devices.

Groups name GPUs per node; a job may hold one group while another group's handoff wants room on a
node they share. The plan must never snapshot or freeze the holder there (it is running its GPU
phase), whichever group asks. This rule needs events only a watcher of etcd can write
(``observer.py``):

    group_spec   group, nodes [{node, gpus}]   a group's spec (gpus [] = every GPU of the node)
    parked       job, node, gpus, state        the agent's status of the job on the node entered
                                               snapshotting / snapshotted / restoring / frozen
                                               (gpus: indexes where the context is; [] = unknown)
    unparked     job, node                     ... left it (running, gone, lost, or deleted)

Holds are the server's grants (``grant_put`` / ``grant_end``) where the observer recorded them,
else the clients' ``granted`` ... ``yield`` / ``error`` / ``abandoned``. A parked interval that
overlaps a hold of the same job on a group whose spec, at the hold's start, names that node with
an overlapping GPU is a violation: ``[cross-group]``. Histories without ``parked`` events are not
judged by this rule.
"""
from __future__ import annotations

import math

PARKED = frozenset({"snapshotting", "snapshotted", "restoring", "frozen"})
_END = math.inf


def check_cross_group(events: list[dict], report, at) -> None:
    """Append ``[cross-group]`` violations to ``report``; ``events`` sorted by t."""
    if not any(e["ev"] == "parked" for e in events):
        return
    specs: dict[str, list[tuple[int, list[dict]]]] = {}
    for e in events:
        if e["ev"] == "group_spec":
            specs.setdefault(e.get("group"), []).append((e["t"], list(e.get("nodes") or [])))
    holds: dict[str, list[tuple]] = {}
    for group, job, token, h0, h1 in _holds(events):
        holds.setdefault(job, []).append((group, token, h0, h1))
    for job, node, gpus, state, p0, p1 in _parked(events):
        for group, token, h0, h1 in holds.get(job, ()):
            if p0 < h1 and h0 < p1 and _covers(_spec_at(specs.get(group, []), h0), node, gpus):
                report.violations.append(
                    f"[cross-group] {job}: {state} on {node} GPUs {gpus or 'all'} at {at(max(p0, h0))} "
                    f"while it held {group} (token {token}, from {at(h0)}), whose devices include them")


def _parked(events: list[dict]):
    """(job, node, gpus, state, start, end) per parking of a job on a node."""
    open_: dict[tuple, list] = {}
    out = []
    for e in events:
        key = (e.get("job"), e.get("node"))
        if e["ev"] == "parked":
            cur = open_.get(key)
            if cur is None:
                open_[key] = [key[0], key[1], sorted(e.get("gpus") or []), e.get("state"), e["t"]]
            elif cur[2] and e.get("gpus"):
                cur[2] = sorted(set(cur[2]) | set(e["gpus"]))
            elif not e.get("gpus"):
                cur[2] = []                                  # unknown now: every GPU
        elif e["ev"] == "unparked" and key in open_:
            out.append((*open_.pop(key), e["t"]))
    out += [(*cur, _END) for cur in open_.values()]
    return out


def _holds(events: list[dict]):
    """(group, job, token, start, end) of every hold: the server's grants where recorded, else the clients'."""
    server = {e.get("group") for e in events if e["ev"] == "grant_put"}
    out, open_ = [], {}
    for e in events:
        ev, group = e["ev"], e.get("group")
        if group in server:
            if ev == "grant_put" and (group not in open_ or open_[group][2] != e.get("token")):
                if group in open_:
                    out.append((*open_.pop(group), e["t"]))
                open_[group] = [group, e.get("job"), e.get("token"), e["t"]]
            elif ev == "grant_end" and group in open_:
                out.append((*open_.pop(group), e["t"]))
        elif ev == "granted":
            open_[(group, e.get("job"))] = [group, e.get("job"), e.get("token"), e["t"]]
        elif ev in ("yield", "error", "abandoned") and (group, e.get("job")) in open_:
            out.append((*open_.pop((group, e.get("job"))), e["t"]))
    out += [(*cur, _END) for cur in open_.values()]
    return out


def _spec_at(history: list[tuple[int, list[dict]]], t: int) -> list[dict]:
    before = [nodes for ts, nodes in history if ts <= t]
    return before[-1] if before else (history[0][1] if history else [])


def _covers(nodes: list[dict], node: str, gpus: list[int]) -> bool:
    for entry in nodes:
        if entry.get("node") != node:
            continue
        mine = set(entry.get("gpus") or [])
        if not mine or not gpus or mine & set(gpus):
            return True
    return False
