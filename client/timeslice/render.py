"""Human-readable text for the CLI: aligned tables and the status picture."""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from timeslice.model import Group, GroupStatus, JobInfo


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(headers), *(fmt(r) for r in cells)])


def human_bytes(n: int) -> str:
    v = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(v) < 1000 or unit == "TB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return f"{n} B"


def _ago(unix_ms: int) -> str:
    if not unix_ms:
        return ""
    s = max(0.0, time.time() - unix_ms / 1000)
    return f"{s:.1f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def groups_table(groups: list[Group], statuses: dict[str, GroupStatus]) -> str:
    if not groups:
        return "no groups (create one with `timeslice group create NAME --node NODE`)"
    rows = []
    for g in groups:
        st = statuses.get(g.group_id)
        holder = (st.holder.job_id + ("" if st.grant else " (swapping in)")) if st and st.holder else "-"
        rows.append([g.group_id, " ".join(map(str, g.nodes)) or "-", holder,
                     len(st.waiters) if st else "?"])
    return table(["GROUP", "NODES", "HOLDER", "WAITING"], rows)


def _state(j) -> str:
    """A snapshotted job is *parked*: say for how long (it must not touch the device meanwhile)."""
    if j.state == "snapshotted" and j.since_unix_ms:
        return f"parked {_ago(j.since_unix_ms)}"
    return j.state


def jobs_table(jobs: list[JobInfo]) -> str:
    if not jobs:
        return "no jobs with a live session"
    return table(["JOB", "LEASE", "GROUPS", "WORKERS", "HOLDS"],
                 [[j.job_id, format(j.lease_id, "x"), ",".join(j.groups) or "-", j.workers,
                   "; ".join(f"{h.group_id} ({weighs(h.footprint_bytes, h.exclusive)})" for h in j.holds) or "-"]
                  for j in jobs])


def weighs(footprint: dict, exclusive: bool) -> str:
    """What a fit group's grant weighs, for humans: "the whole device" or bytes per node/GPU."""
    if exclusive or not footprint:
        return "weighs the whole device"
    return "weighs " + ", ".join(f"{human_bytes(b)} on {where}" for where, b in sorted(footprint.items()))


def _holder(g) -> str:
    how = "restored" if g.restored else ("elided" if g.elided else "resident")
    how += ", backfilled" if g.backfilled else ""
    return (f"{g.job_id}  token {g.token}  granted {_ago(g.granted_unix_ms)}  ({how})  "
            f"{weighs(g.footprint_bytes, g.exclusive)}")


def status_text(st: GroupStatus) -> str:
    lines = [f"group    {st.group_id}   (leader epoch {st.leader_epoch}, etcd revision {st.revision})",
             f"nodes    {' '.join(map(str, st.nodes)) or '-'}"]
    if st.sharing == "fit":
        lines.append("sharing  fit (holders side by side where their footprints fit; the rest time-sliced)")
    if st.sharing == "fit" and st.holders:
        for i, g in enumerate(st.holders):
            lines.append(("holders  " if i == 0 else "         ") + _holder(g))
    elif st.holder is None:
        lines.append("holder   - (idle)")
    elif st.grant is None or st.grant.token != st.holder.token:
        lines.append(f"holder   {st.holder.job_id}  token {st.holder.token}  (not granted yet: swapping in)")
    else:
        g = st.grant
        how = "restored" if g.restored else ("elided" if g.elided else "resident")
        moved = f", {human_bytes(g.bytes_moved)} moved" if g.bytes_moved else ""
        lines.append(f"holder   {g.job_id}  token {g.token}  granted {_ago(g.granted_unix_ms)}  ({how}{moved})")
    if st.waiters:
        classes = any(w.priority for w in st.waiters)   # a priority group's waiters: say each one's class
        lines.append("waiting  " + "  ".join(
            f"{i}. {w.job_id} (token {w.token}{f', class {w.priority}' if classes else ''})"
            for i, w in enumerate(st.waiters, 1)))
    else:
        lines.append("waiting  -")
    if st.node_status:
        lines.append("")
        lines.append(table(["NODE", "AGENT", "BACKEND", "RESIDENT", "DEVICE FREE/TOTAL"], [
            [n.node, "alive" if n.agent_alive else "DOWN", n.backend or "-", ",".join(n.resident_jobs) or "-",
             f"{human_bytes(n.device_free_bytes)} / {human_bytes(n.device_total_bytes)}"
             if n.device_total_bytes else "-"]
            for n in st.node_status]))
        job_rows = [[n.node, j.job_id, _state(j), human_bytes(j.device_bytes) if j.device_bytes else "-",
                     human_bytes(j.residue_bytes) if j.residue_bytes else "-", human_bytes(j.bytes) if j.bytes else "-",
                     f"{j.elapsed_ms:.0f} ms" if j.elapsed_ms else "-", j.token or "-", j.error or ""]
                    for n in st.node_status for j in n.jobs]
        if job_rows:
            lines.append("")
            lines.append(table(["NODE", "JOB", "STATE", "FOOTPRINT", "RESIDUE", "MOVED", "ELAPSED", "TOKEN", "ERROR"],
                               job_rows))
    return "\n".join(lines)
