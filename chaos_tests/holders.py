"""Invariants judged from etcd's own history: a holder is never parked; grants in revision order.

The rule: a job that holds any group is never parked on that group's
devices (README, "Jobs over several GPUs and nodes"). Checked over etcd's revision order (a total order, no clocks): at
the revision a ``snapshot`` intent for job J on node n is written, J must not
hold a grant on a group whose spec names n on a GPU where J has registered
workers (a worker without declared GPUs, or a spec entry without GPUs, counts
as every GPU of the node: not knowing is not proof of innocence).

Inputs are the put/delete events of the whole prefix in revision order
(``etcd_history`` reads them with a watch from revision 1, so run it before
any compaction). Pure function, no etcd needed to test it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from timeslice.common.server.keys import Keys

ALL = frozenset({-1})                  # "every GPU of the node"


@dataclass(frozen=True)
class Event:
    revision: int
    key: bytes
    value: bytes | None                # None: deleted


def _gpus(raw: list | None) -> frozenset[int]:
    return frozenset(int(g) for g in raw) if raw else ALL


def _meet(a: frozenset[int], b: frozenset[int]) -> bool:
    return -1 in a or -1 in b or bool(a & b)


def check_holders_not_parked(events: Iterable[Event], keys: Keys) -> list[str]:
    """Violations as ``[parked-holder] ...`` lines (empty: the invariant held)."""
    specs: dict[str, dict[str, frozenset[int]]] = {}     # group -> node -> GPUs
    grants: dict[str, set[str]] = {}                     # group -> its holders (a fit group: several)
    workers: dict[tuple[str, str, int], frozenset[int]] = {}   # (job, node, pid) -> GPUs
    out: list[str] = []
    for ev in sorted(events, key=lambda e: e.revision):
        try:
            parts = keys.parse(ev.key)
        except ValueError:
            continue
        val = json.loads(ev.value) if ev.value else None
        if parts[0] == "groups" and len(parts) == 3 and parts[2] == "spec":
            if val is None:
                specs.pop(parts[1], None)
            else:
                specs[parts[1]] = {n["node"]: _gpus(n.get("gpus")) for n in val.get("nodes", [])}
        elif keys.grant_of(ev.key) is not None:
            held = grants.setdefault(parts[1], set())
            if len(parts) == 3:                      # an exclusive group's one grant key: its value names the job
                held.clear()
                if val is not None:
                    held.add(val["job"])
            elif val is None:
                held.discard(parts[3])
            else:
                held.add(parts[3])
        elif parts[0] == "jobs" and len(parts) == 5 and parts[2] == "workers" and parts[4].isdigit():
            k = (parts[1], parts[3], int(parts[4]))
            if val is None:
                workers.pop(k, None)
            else:
                workers[k] = _gpus(val.get("gpus"))
        elif parts[0] == "nodes" and len(parts) == 4 and parts[2] == "intents" and val is not None:
            if val.get("op") != "snapshot":
                continue
            job, node = parts[3], parts[1]
            on = [g for (j, n, _), g in workers.items() if j == job and n == node] or [ALL]
            for group, holders in grants.items():
                where = specs.get(group, {}).get(node)
                if job in holders and where is not None and any(_meet(where, g) for g in on):
                    out.append(f"[parked-holder] revision {ev.revision}: snapshot of {job} on {node} "
                               f"(for group {val.get('group')}, token {val.get('token')}) while it holds "
                               f"{group} there")
    return out


def check_grants_in_revision_order(events: Iterable[Event], keys: Keys, margin: int = 0) -> list[str]:
    """Grants judged in etcd's own total order (no clocks), every group, both layouts:

    * ``[token-order]`` each grant put of a group carries a token above every token granted on the
      group before it (tokens strictly increase in grant order: also past a fit group's backfills);
    * ``[fit]`` a fit group's holders at each grant (its key ``grants/<job>``): an exclusive one (or
      one without a footprint) is alone, and on each GPU their footprints stay within the capacity
      the node's agent reported last, less ``margin``. (An exclusive group's one key ``grant`` holds
      one holder by construction.)"""
    caps: dict[str, int] = {}                            # "<node>/<GPU index>" -> total bytes
    high: dict[str, int] = {}                            # group -> highest token granted so far
    shared: dict[str, dict[str, dict]] = {}              # fit group -> job -> its grant
    single: dict[str, str] = {}                          # exclusive group -> holder
    out: list[str] = []
    for ev in sorted(events, key=lambda e: e.revision):
        try:
            parts = keys.parse(ev.key)
        except ValueError:
            continue
        val = json.loads(ev.value) if ev.value else None
        if parts[0] == "nodes" and len(parts) == 3 and parts[2] == "agent" and val is not None:
            for g in val.get("gpus", []):
                caps[f"{parts[1]}/{g.get('index')}"] = int(g.get("total_bytes", 0))
            continue
        held = keys.grant_of(ev.key)
        if held is None:
            continue
        group, job = held
        if val is None:
            if job:
                shared.get(group, {}).pop(job, None)
            else:
                single.pop(group, None)
            continue
        token = int(val.get("token", 0))
        if job and job in shared.get(group, {}) and shared[group][job].get("token") == token:
            continue                                     # the same grant re-put
        if not job and single.get(group) == val.get("job") and high.get(group) == token:
            continue
        if token <= high.get(group, 0):
            out.append(f"[token-order] revision {ev.revision}: {group} granted token {token} to {val.get('job')} "
                       f"after token {high[group]}")
        high[group] = max(high.get(group, 0), token)
        if not job:
            single[group] = val.get("job")
            continue
        holders = shared.setdefault(group, {})
        holders[job] = val
        if len(holders) < 2:
            continue
        if any(v.get("exclusive") or not v.get("footprint") for v in holders.values()):
            out.append(f"[fit] revision {ev.revision}: {group} holders {sorted(holders)} beside one that weighs "
                       "the whole device")
            continue
        load: dict[str, int] = {}
        for v in holders.values():
            for slot, b in v.get("footprint", {}).items():
                load[slot] = load.get(slot, 0) + int(b)
        for slot, b in sorted(load.items()):
            if slot not in caps or b > caps[slot] - margin:
                out.append(f"[fit] revision {ev.revision}: {group} holders {sorted(holders)} admitted {b} bytes on "
                           f"{slot}, capacity {caps.get(slot, 'unknown')} less margin {margin}")
    return out


async def etcd_history(client, keys: Keys, upto: int | None = None) -> list[Event]:
    """Every put/delete under the prefix from revision 1 to ``upto`` (default: now)."""
    from timeslice.common.server.etcd import ops
    from timeslice.common.server.etcd.watch import Watch
    if upto is None:
        upto = (await client.range(ops.range_req(keys.prefix.encode(), prefix=True, count_only=True))
                ).header.revision
    out: list[Event] = []
    async with Watch(client, keys.prefix.encode(), start_revision=1, prefix=True) as w:
        async for batch in w:
            for ev in batch:
                out.append(Event(ev.revision, ev.kv.key, ev.kv.value if ev.is_put else None))
            if batch and batch[-1].revision >= upto:
                break
    return [e for e in out if e.revision <= upto]
