"""A chaos scenario's figures: grants, faults and how soon a grant followed each, errors, violations.

Printed (run pytest with ``-s``) and written to ``figures.txt`` in the scenario's
folder, with one ``json:`` line for tools.
"""
from __future__ import annotations

import json
import os

from chaos_tests.checker import Report


def fault_recoveries(faults: list, events: list[dict]) -> list[float | None]:
    """For each fault: seconds from its injection to the next grant in any group."""
    grants = sorted(e["t"] for e in events if e["ev"] == "granted")
    out = []
    for f in faults:
        t = int(f.t0 * 1e9)
        nxt = next((g for g in grants if g > t), None)
        out.append(round((nxt - t) / 1e9, 3) if nxt else None)
    return out


def print_figures(world, report: Report, events: list[dict]) -> None:
    """The scenario's figures: printed (pytest -s) and kept in <workdir>/figures.txt."""
    rec = fault_recoveries(world.faults, events)
    by_kind: dict[str, int] = {}
    for e in events:
        if e["ev"] == "error":
            k = e.get("kind", "?")
            by_kind[k] = by_kind.get(k, 0) + 1
    figures = {
        "scenario": world.name, "seed": world.seed,
        "duration_s": round(world.elapsed(), 1),
        "grants": report.grants, "acquires": report.acquires, "groups": report.groups,
        "jobs": report.jobs, "critical_sections": report.critical_sections,
        "faults_injected": len(world.faults),
        "longest_gap_without_grant_s": round(report.max_grant_gap_s, 3),
        "longest_wait_s": round(report.max_wait_s, 3),
        "errors": report.errors, "errors_by_kind": by_kind, "abandoned": report.abandoned,
        "session_lost_signals": sum(1 for e in events if e["ev"] == "session_lost"),
        "server_grants_observed": sum(1 for e in events if e["ev"] == "grant_put"),
        "fence_rejections": report.fence_rejections, "fenced_sections": report.fenced_sections,
        "data_checks": sum(1 for e in events if e["ev"] == "data_check"),
        "memory_reports": sum(1 for e in events if e["ev"] == "memory"),
        "cooperative_pauses": sum(1 for e in events if e["ev"] == "coop_paused"),
        "cooperative_resumes": sum(1 for e in events if e["ev"] == "coop_resumed"),
        "grants_with_restore": sum(1 for e in events if e["ev"] == "granted" and e.get("restored")),
        # fit groups: grants made before an earlier waiter (each judged by holders.py's [starve])
        "grants_backfilled": sum(1 for e in events if e["ev"] == "granted" and e.get("backfilled")),
        "slowest_group_recovery_after_heal_s": (None if any(r is None for *_, r in report.recoveries) else
                                                max((r for *_, r in report.recoveries), default=None)),
        "violations": len(report.violations),
        "client_crashes": len(world.crashes),
    }
    lines = [f"===== chaos scenario {world.name} (seed {world.seed}; histories and logs in {world.dir}) ====="]
    width = max(len(k) for k in figures)
    lines += [f"  {k:<{width}}  {json.dumps(v)}" for k, v in figures.items()]
    lines.append("  faults:")
    after_heal = [(a, b) for _, a, b in report.recoveries]
    after_heal += [(None, None)] * (len(world.faults) - len(after_heal))
    for f, r, h in zip(world.faults, rec, after_heal):
        lines.append(f"    +{f.t0 - world.t_start:6.2f}s  {f.what}"
                     + (f" (for {f.t1 - f.t0:.2f}s)" if f.t1 else "")
                     + f"  first grant after injection: {r}s, after heal: {h[0]}s (slowest group {h[1]}s)"
                     + (f"  {f.detail}" if f.detail else ""))
    for v in report.violations[:50]:
        lines.append(f"  VIOLATION {v}")
    for c in world.crashes:
        lines.append(f"  CRASH {c}")
    lines.append("  json: " + json.dumps({**figures, "fault_list": [
        {"what": f.what, "at_s": round(f.t0 - world.t_start, 2),
         "for_s": round(f.t1 - f.t0, 2) if f.t1 else None, "next_grant_s": r, "next_grant_after_heal_s": h[0],
         "slowest_group_after_heal_s": h[1]}
        for f, r, h in zip(world.faults, rec, after_heal)], "violation_list": report.violations[:50]}))
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(world.dir, "figures.txt"), "w") as f:
        f.write(text + "\n")
