"""The operator's page: who held each group (and its GPUs) when, the swaps, the waits, the duty cycle.

Sans-IO: ``build`` takes what etcd holds (the leader's records of finished holds,
``<prefix>history/``, lockd/history.py; the groups' specs, grants and queues now) and a
time window, and returns a ``Report``; ``html`` renders it as one self-contained HTML
file (inline CSS and SVG, no script, no external resource), with the figures also
embedded as JSON (``<script type="application/json" id="timeslice-report">``) for tools;
``timeline_runs`` gives the demo's timeline picture (``timeslice.lockd.report.timeline``) one
panel per group. ``timeslice report`` (cli_report.py) reads etcd and writes the files.

Figures per group, within the window: holds (a hold still in progress ends at the
report's time), held time (the union of the holds), duty cycle (held time over the
group's *active window*, from its first wait or hold to the end of its last hold: the
share of that time in which some job held the group's GPUs; ``window_share`` is held time
over the whole report window), handoffs (consecutive holds of different jobs), swaps
(holds whose Acquire moved bytes), restored holds, elided holds (the job was granted with
another job left resident on its GPUs) split in two: ``fit beside`` (nobody was paused:
it fit in the free memory) and ``partial pause`` (a resident released only some regions,
as much as the incoming job needed, and stayed), bytes moved, swap time (per hold, the
slowest node's snapshot and restore time), waits (grant time - enqueue time), and whether
any two holds overlap (they must not). Per GPU (the agents' answers name the GPUs a swap
moved): swaps, bytes out and in. ``figures`` is that, per group, for ``report --json``.
"""
from __future__ import annotations

import html as _html
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from itertools import pairwise

from timeslice.common.server import records as R
from timeslice.lockd.report.figures import RunFigures, overlapping_pairs, union_length

SNAPSHOT, RESTORE = R.SNAPSHOT, R.RESTORE


@dataclass
class Hold:
    job: str
    token: int
    start: float                # unix seconds, clipped to the window
    end: float
    granted: float              # unix seconds, as recorded
    waited_s: float | None      # grant - enqueue (None: enqueue time unknown)
    restored: bool
    elided: bool
    bytes_moved: int
    swap_s: float               # the slowest node's snapshot + restore time for this grant
    swaps: list[dict] = field(default_factory=list)
    ongoing: bool = False
    footprint: dict = field(default_factory=dict)    # fit groups: "<node>/<GPU>" -> admitted bytes
    exclusive: bool = False                          # fit groups: weighed the whole device
    backfilled: bool = False                         # fit groups: granted before an earlier waiter


@dataclass
class GpuFigures:
    node: str
    gpu: str
    swaps: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    seconds: float = 0.0


@dataclass
class GroupFigures:
    group: str
    nodes: list[str]            # "node" (all its GPUs) or "node:0,1"
    holds: list[Hold]
    waiting: list[dict]         # now: [{"job", "since"}] behind the holder
    held_s: float = 0.0
    duty: float = 0.0                    # held_s / (active_to - active_from)
    active_from: float = 0.0             # the group's active window: first wait or hold ...
    active_to: float = 0.0               # ... to the end of its last hold (unix seconds)
    window_share: float = 0.0            # held_s / the report's whole window
    handoffs: int = 0
    swaps: int = 0
    restored: int = 0
    elided: int = 0                      # elided_fit_beside + elided_partial_pause
    elided_fit_beside: int = 0
    elided_partial_pause: int = 0
    bytes_moved: int = 0
    swap_s: float = 0.0
    wait_p50_s: float | None = None
    wait_max_s: float | None = None
    overlaps: int = 0
    gpus: list[GpuFigures] = field(default_factory=list)
    sharing: str = R.SHARING_EXCLUSIVE   # a fit group's holds overlap by design (there: held side by side)


@dataclass
class Report:
    since: float
    until: float
    prefix: str
    groups: list[GroupFigures]

    @property
    def window_s(self) -> float:
        return self.until - self.since

    @property
    def drawn_from(self) -> float:
        """Where the pictures start: the first wait or hold in the window (a second before it),
        so ten quiet minutes do not squeeze a few seconds of handoffs into a line."""
        starts = [h.start if h.waited_s is None else min(h.start, h.granted - h.waited_s)
                  for g in self.groups for h in g.holds]
        return max(self.since, min(starts, default=self.since) - 1.0)

    def to_dict(self) -> dict:
        return asdict(self)


def _node_text(spec: dict) -> str:
    gpus = spec.get("gpus") or []
    return spec.get("node", "?") + (":" + ",".join(str(g) for g in gpus) if gpus else "")


def _hold(rec: R.HoldRecord, since: float, until: float, ongoing: bool = False) -> Hold | None:
    granted = rec.granted_ms / 1000
    end = until if ongoing else rec.released_ms / 1000
    start, end = max(granted, since), min(end, until)
    if end < start or (not ongoing and rec.released_ms / 1000 < since):
        return None
    per_node: dict[str, float] = {}
    for op in rec.swaps:
        per_node[op.get("node", "?")] = per_node.get(op.get("node", "?"), 0.0) + float(op.get("elapsed_ms", 0)) / 1000
    waited = (rec.granted_ms - rec.enqueued_ms) / 1000 if rec.enqueued_ms else None
    return Hold(rec.job, rec.token, start, end, granted, waited, rec.restored, rec.elided, rec.bytes_moved,
                max(per_node.values(), default=0.0), list(rec.swaps), ongoing, dict(rec.footprint), rec.exclusive,
                rec.backfilled)


def build(records: Iterable[R.HoldRecord], specs: Mapping[str, R.GroupSpec],
          grants: Mapping[str, list[R.GrantValue]], queues: Mapping[str, list[R.QueueValue]], since: float,
          until: float | None = None, prefix: str = "", only: Iterable[str] = ()) -> Report:
    """The report of ``[since, until]`` (unix seconds) from etcd's records and state; ``grants``: every
    holder's grant now, per group (a fit group may have several)."""
    until = time.time() if until is None else until
    wanted = set(only)
    by_group: dict[str, list[R.HoldRecord]] = {}
    for rec in records:
        by_group.setdefault(rec.group, []).append(rec)
    names = sorted(set(by_group) | set(specs) | set(grants))
    out = []
    for g in names:
        if wanted and g not in wanted:
            continue
        holds = [h for h in (_hold(r, since, until) for r in sorted(by_group.get(g, []), key=lambda r: r.token))
                 if h is not None]
        q = {e.job: e for e in queues.get(g, [])}
        for grant in sorted(grants.get(g, []), key=lambda v: v.token):
            if any(h.token == grant.token for h in holds):
                continue
            entry = q.get(grant.job)
            rec = R.HoldRecord(g, grant.job, grant.token, grant.leader_epoch,
                               enqueued_ms=entry.enqueued_ms if entry else 0, granted_ms=grant.granted_ms,
                               restored=grant.restored, elided=grant.elided, bytes_moved=grant.bytes_moved,
                               footprint=dict(grant.footprint), exclusive=grant.exclusive,
                               backfilled=grant.backfilled)
            now = _hold(rec, since, until, ongoing=True)
            if now is not None:
                holds.append(now)
        spec = specs.get(g)
        holders = {v.job for v in grants.get(g, [])}
        waiting = [{"job": e.job, "since": e.enqueued_ms / 1000} for e in queues.get(g, []) if e.job not in holders]
        fig = GroupFigures(g, [_node_text(n) for n in spec.nodes] if spec else [], holds, waiting,
                           sharing=spec.sharing if spec else R.SHARING_EXCLUSIVE)
        _figures(fig, since, until)
        out.append(fig)
    return Report(since, until, prefix, out)


def partial_pause(h: Hold) -> bool:
    """An elided hold whose swap paused another job in part (it stayed resident beside this one)."""
    return h.elided and any(op.get("op") == SNAPSHOT and op.get("job") != h.job for op in h.swaps)


def _figures(f: GroupFigures, since: float, until: float) -> None:
    hs, window = f.holds, until - since
    f.held_s = union_length([(h.start, h.end) for h in hs])
    if hs:
        f.active_from = max(since, min(h.start if h.waited_s is None else min(h.start, h.granted - h.waited_s)
                                       for h in hs))
        f.active_to = max(h.end for h in hs)
    active = f.active_to - f.active_from
    f.duty = f.held_s / active if active > 0 else 0.0
    f.window_share = f.held_s / window if window > 0 else 0.0
    f.handoffs = sum(1 for a, b in pairwise(hs) if a.job != b.job)
    f.swaps = sum(1 for h in hs if h.bytes_moved > 0)
    f.restored = sum(1 for h in hs if h.restored)
    f.elided = sum(1 for h in hs if h.elided)
    f.elided_partial_pause = sum(1 for h in hs if partial_pause(h))
    f.elided_fit_beside = f.elided - f.elided_partial_pause
    f.bytes_moved = sum(h.bytes_moved for h in hs)
    f.swap_s = sum(h.swap_s for h in hs)
    waits = [h.waited_s for h in hs if h.waited_s is not None]
    if waits:
        f.wait_p50_s, f.wait_max_s = statistics.median(waits), max(waits)
    f.overlaps = len(overlapping_pairs([{"job": h.job, "t_start": h.start, "t_end": h.end} for h in hs]))
    gpus: dict[tuple[str, str], GpuFigures] = {}
    for h in hs:
        for op in h.swaps:
            per = op.get("gpu_bytes") or {"": op.get("bytes", 0)}
            for gpu, nbytes in per.items():
                gf = gpus.setdefault((op.get("node", "?"), gpu), GpuFigures(op.get("node", "?"), gpu))
                gf.swaps += 1
                gf.seconds += float(op.get("elapsed_ms", 0)) / 1000 / max(1, len(per))
                if op.get("op") == SNAPSHOT:
                    gf.bytes_out += int(nbytes)
                elif op.get("op") == RESTORE:
                    gf.bytes_in += int(nbytes)
    f.gpus = [gpus[k] for k in sorted(gpus)]


def figures(rep: Report) -> dict[str, dict]:
    """Per group, the figures a tool reads (``timeslice report --json``): no hold list, every count."""
    out = {}
    for g in rep.groups:
        waits = [h.waited_s for h in g.holds if h.waited_s is not None]
        out[g.group] = {
            "nodes": g.nodes, "holds": len(g.holds), "jobs": sorted({h.job for h in g.holds}),
            "held_s": round(g.held_s, 3), "duty": round(g.duty, 4),
            "duty_window": {"from": g.active_from, "to": g.active_to,
                            "s": round(max(0.0, g.active_to - g.active_from), 3)},
            "window_share": round(g.window_share, 4), "handoffs": g.handoffs, "swaps": g.swaps,
            "restored": g.restored,
            "elided": {"total": g.elided, "fit_beside": g.elided_fit_beside, "partial_pause": g.elided_partial_pause},
            "bytes_moved": g.bytes_moved, "swap_s": round(g.swap_s, 3),
            "waits": {"count": len(waits), "p50_s": g.wait_p50_s, "max_s": g.wait_max_s},
            "waiting_now": [w["job"] for w in g.waiting], "overlaps": g.overlaps, "sharing": g.sharing,
            "gpus": [asdict(gf) for gf in g.gpus],
        }
    return out


def text(rep: Report) -> str:
    """The figures for a person on a terminal, one block per group."""
    lines = []
    for g in rep.groups:
        if not g.holds:
            lines.append(f"  {g.group}: no holds in the window")
            continue
        lines.append(f"  {g.group}: {len(g.holds)} holds by {len({h.job for h in g.holds})} jobs; duty {g.duty:.1%} "
                     f"over {_t(g.active_from)[:8]}–{_t(g.active_to)[:8]} ({g.active_to - g.active_from:.1f} s, "
                     f"from the first wait or hold to the last release)")
        lines.append(f"    swaps {g.swaps} ({_b(g.bytes_moved)}, {g.swap_s:.2f} s), restored {g.restored}, "
                     f"elided {g.elided} ({g.elided_fit_beside} fit beside, {g.elided_partial_pause} partial pause), "
                     f"handoffs {g.handoffs}, overlaps {g.overlaps}, waits p50 {_s(g.wait_p50_s)} "
                     f"max {_s(g.wait_max_s)}")
    return "\n".join(lines)


# -- the demo's timeline picture ---------------------------------------------------------------

def timeline_runs(rep: Report) -> list[tuple[RunFigures, dict[str, list[dict]]]]:
    """One panel per group for ``timeslice.lockd.report.timeline.draw``: a row per job, its holds as phases,
    the wait before each hatched, swaps marked with the bytes they moved."""
    runs = []
    for g in rep.groups:
        by_job: dict[str, list[dict]] = {}
        for h in g.holds:
            ev = {"type": "phase", "phase": "hold", "gpu": True, "job": h.job, "label": h.job,
                  "t_start": h.start, "t_end": h.end, "token": h.token, "bytes_moved": h.bytes_moved,
                  "elided": h.elided, "restored": h.restored}
            if h.waited_s is not None:
                ev["t_request"] = max(rep.drawn_from, h.granted - h.waited_s)
            by_job.setdefault(h.job, []).append(ev)
        span = rep.until - rep.drawn_from            # the panel's duty cycle is over what it shows
        fig = RunFigures(g.group, f"group {g.group} ({' '.join(g.nodes) or 'spec gone'})", "sliced", 0,
                         t0=rep.drawn_from, wall_s=span, gpu_busy_s=g.held_s,
                         duty=g.held_s / span if span > 0 else 0.0, grants=len(g.holds), handoffs=g.handoffs,
                         swaps=g.swaps, restores=g.restored, elided=g.elided, bytes_moved=g.bytes_moved,
                         overlaps=g.overlaps, jobs=sorted(by_job))
        runs.append((fig, by_job))
    return runs


# -- HTML ----------------------------------------------------------------------------------------

def _b(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _t(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix)) + f".{int(unix * 1000) % 1000:03d}"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f} s"


def _window(g: GroupFigures) -> str:
    if not g.holds:
        return "–"
    return f"{_t(g.active_from)[:8]}–{_t(g.active_to)[:8]} ({g.active_to - g.active_from:.1f} s)"


def _weighs(h: Hold) -> str:
    """What a fit group's hold was admitted with."""
    if h.exclusive or not h.footprint:
        return "the whole device"
    return ", ".join(f"{_b(int(b))} on {where}" for where, b in sorted(h.footprint.items())) + \
        (" (backfilled)" if h.backfilled else "")


def _e(v: object) -> str:
    return _html.escape(str(v), quote=True)


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.figs td{text-align:left}
.bad{color:#b00020;font-weight:bold}svg{border:1px solid #ddd;background:#fff}
"""
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def _svg(rep: Report, g: GroupFigures) -> str:
    jobs = sorted({h.job for h in g.holds})
    width, left, row = 960, 160, 26
    height = 30 + row * max(1, len(jobs))
    t0 = rep.drawn_from
    span = max(rep.until - t0, 1e-9)

    def x(t: float) -> float:
        return left + (max(t, t0) - t0) / span * (width - left - 10)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="holds of group {_e(g.group)}">',
             '<defs><pattern id="wait" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4cccc"/>'
             '<line x1="0" y1="0" x2="0" y2="6" stroke="#cc4125" stroke-width="2"/></pattern></defs>']
    for i, job in enumerate(jobs):
        y = 10 + i * row
        parts.append(f'<text x="4" y="{y + 15}" font-size="12">{_e(job[:22])}</text>')
        for h in (h for h in g.holds if h.job == job):
            if h.waited_s:
                w0 = max(t0, h.granted - h.waited_s)
                parts.append(f'<rect class="wait" x="{x(w0):.1f}" y="{y + 4}" width="{max(0.5, x(h.start) - x(w0)):.1f}" '
                             f'height="14" fill="url(#wait)"><title>{_e(job)} waited {h.waited_s:.3f} s</title></rect>')
            color = PALETTE[i % len(PALETTE)]
            parts.append(f'<rect class="hold" x="{x(h.start):.1f}" y="{y}" width="{max(0.5, x(h.end) - x(h.start)):.1f}" '
                         f'height="20" fill="{color}"><title>{_e(job)} token {h.token}: {_t(h.start)} – {_t(h.end)}'
                         f'{" (holding)" if h.ongoing else ""}, moved {_b(h.bytes_moved)}</title></rect>')
            if h.bytes_moved > 0:
                parts.append(f'<path class="swap" d="M{x(h.start) - 4:.1f},{y - 2} h8 l-4,6 z" fill="#d62728"/>')
    axis_y = height - 8
    for k in range(6):
        t = t0 + span * k / 5
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y}" font-size="10" text-anchor="middle">{_t(t)[:8]}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html(rep: Report, title: str = "timeslice report") -> str:
    """The whole page, one self-contained document."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{_e(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>{_e(title)}</h1>",
           f"<p>Window: {_e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rep.since)))} – "
           f"{_e(time.strftime('%H:%M:%S', time.localtime(rep.until)))} ({rep.window_s:.0f} s), "
           f"prefix <code>{_e(rep.prefix)}</code>, {len(rep.groups)} group(s). Holds come from the "
           "leader's records of finished holds; a hold in progress ends at the report's time.</p>"]
    out.append('<table class="summary"><tr><th class="l">group</th><th class="l">GPUs</th><th>holds</th>'
               "<th>jobs</th><th>duty cycle</th><th class=\"l\">over</th><th>handoffs</th><th>swaps</th>"
               "<th>elided: fit beside</th><th>elided: partial pause</th><th>moved</th>"
               "<th>swap time</th><th>wait p50</th><th>wait max</th><th>waiting now</th><th>overlaps</th></tr>")
    for g in rep.groups:
        out.append(f'<tr><td class="l"><a href="#g-{_e(g.group)}">{_e(g.group)}</a></td>'
                   f'<td class="l">{_e(" ".join(g.nodes) or "–")}</td><td>{len(g.holds)}</td>'
                   f"<td>{len({h.job for h in g.holds})}</td><td>{g.duty:.1%}</td>"
                   f'<td class="l">{_window(g)}</td><td>{g.handoffs}</td>'
                   f"<td>{g.swaps}</td><td>{g.elided_fit_beside}</td><td>{g.elided_partial_pause}</td>"
                   f"<td>{_b(g.bytes_moved)}</td><td>{_s(g.swap_s)}</td>"
                   f"<td>{_s(g.wait_p50_s)}</td><td>{_s(g.wait_max_s)}</td><td>{len(g.waiting)}</td>"
                   f'<td{" class=bad" if g.overlaps and g.sharing != R.SHARING_FIT else ""}>{g.overlaps}'
                   f'{" (shared)" if g.sharing == R.SHARING_FIT else ""}</td></tr>')
    out.append("</table>")
    for g in rep.groups:
        out.append(f'<h2 id="g-{_e(g.group)}">group {_e(g.group)}</h2>')
        out.append(f"<p>GPUs: {_e(' '.join(g.nodes) or 'the group no longer exists')}; held {g.held_s:.1f} s of "
                   f"its active window {_window(g)} (duty cycle {g.duty:.1%}; {g.window_share:.1%} of the report's "
                   f"{rep.window_s:.0f} s); {g.handoffs} handoffs, {g.swaps} swaps moving "
                   f"{_b(g.bytes_moved)} in {g.swap_s:.2f} s; {g.elided} elided ({g.elided_fit_beside} fit beside: "
                   f"nobody paused; {g.elided_partial_pause} partial pause: a resident released part of its "
                   f"regions and stayed).</p>")
        fit = g.sharing == R.SHARING_FIT
        if fit:
            out.append(f"<p>Sharing: fit. Holders run side by side where their admitted footprints fit on the "
                       f"GPUs ({g.overlaps} overlapping pairs of holds); the rest is time-sliced.</p>")
        if g.holds:
            out.append(_svg(rep, g))
            out.append("<p><small>Bars: holds (one row per job; hover for times and tokens). Hatched: waiting "
                       "for the group, the swap that made room included. Red mark: the grant moved bytes.</small></p>")
        if g.waiting:
            out.append("<p>Waiting now: " + ", ".join(f"{_e(w['job'])} (since {_t(w['since'])})"
                                                      for w in g.waiting) + "</p>")
        out.append('<table class="holds"><tr><th class="l">job</th><th>token</th><th>from</th><th>to</th>'
                   "<th>held</th><th>waited</th><th>restored</th><th>elided</th><th>moved</th><th>swap time</th>"
                   + ('<th class="l">admitted</th>' if fit else "")
                   + '<th class="l">swap operations (node, op, job, bytes, time, GPUs)</th></tr>')
        for h in g.holds:
            ops_text = "; ".join(
                f"{op.get('node')} {op.get('op')} {op.get('job')} {_b(int(op.get('bytes', 0)))} "
                f"{float(op.get('elapsed_ms', 0)) / 1000:.3f} s [{', '.join(sorted(op.get('gpu_bytes') or {}))}]"
                for op in h.swaps)
            out.append(f'<tr class="hold"><td class="l">{_e(h.job)}</td><td>{h.token}</td><td>{_t(h.start)}</td>'
                       f'<td>{_t(h.end)}{" (holding)" if h.ongoing else ""}</td><td>{h.end - h.start:.3f} s</td>'
                       f"<td>{_s(h.waited_s)}</td><td>{'yes' if h.restored else ''}</td>"
                       f"<td>{'yes' if h.elided else ''}</td><td>{_b(h.bytes_moved)}</td><td>{_s(h.swap_s)}</td>"
                       + (f'<td class="l">{_e(_weighs(h))}</td>' if fit else "")
                       + f'<td class="l">{_e(ops_text)}</td></tr>')
        out.append("</table>")
        if g.gpus:
            out.append('<table class="gpus"><tr><th class="l">node</th><th class="l">GPU</th><th>swaps</th>'
                       "<th>out (snapshot)</th><th>in (restore)</th><th>time</th></tr>")
            for gf in g.gpus:
                out.append(f'<tr><td class="l">{_e(gf.node)}</td><td class="l">{_e(gf.gpu or "?")}</td>'
                           f"<td>{gf.swaps}</td><td>{_b(gf.bytes_out)}</td><td>{_b(gf.bytes_in)}</td>"
                           f"<td>{gf.seconds:.3f} s</td></tr>")
            out.append("</table>")
    data = json.dumps(rep.to_dict(), sort_keys=True).replace("</", "<\\/")
    out.append(f'<script type="application/json" id="timeslice-report">{data}</script>')
    out.append("</body></html>")
    return "\n".join(out)
