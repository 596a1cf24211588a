"""Run every control-plane benchmark, one after another, and print the summary table.

    python -m benchmarks.run_all                 # everything, default sizes (about 5-6 minutes)
    python -m benchmarks.run_all --only handoff scale
    python -m benchmarks.run_all --table-only    # re-print the table from benchmarks/results/*.json

Each benchmark runs as its own process (``python -m benchmarks.<name>``), so
none inherits another's event loop, channels or leftovers, and each records its
exact command in benchmarks/results/<name>.json. They never run at the same
time: the machine's cores are shared by client, lockd and etcd already. The
table is written to benchmarks/results/summary.md as well (the README's table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import common as C

BENCHMARKS = {
    "handoff": [],
    "polling_baseline": [],
    "scale": [],
    "failover": [],
}


def _load(name: str) -> dict | None:
    try:
        with open(os.path.join(C.RESULTS, f"{name}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows() -> list[list[str]]:
    out: list[list[str]] = []
    h = _load("handoff")
    if h:
        for r in h["figures"]["runs"]:
            m, hs, fs = r["etcd_members"], r["handoff_ms"], r["floor_ms"]
            out.append([f"Handoff p50, {m} etcd member{'s' if m > 1 else ''} (n={hs['n']})",
                        f"{hs['p50']:.2f} ms = {r['ratio_p50']:.2f}x floor (floor p50 {fs['p50']:.2f} ms)",
                        f"<= {h['targets']['p50_over_floor_p50']:g}x floor", C.verdict(r["pass_ratio"])])
            out.append([f"Handoff p99 / max, {m} etcd member{'s' if m > 1 else ''}",
                        f"{hs['p99']:.1f} / {hs['max']:.1f} ms (floor p99 {fs['p99']:.2f} ms)",
                        f"p99 <= {h['targets']['p99_ms']:g} ms", C.verdict(r["pass_p99"])])
    p = _load("polling_baseline")
    if p:
        f = p["figures"]
        out.append([f"Polling baseline (1 s poll), handoff p50 (n={f['polling_handoff_ms']['n']})",
                    (f"{f['polling_handoff_ms']['p50']:.0f} ms vs timeslice {f['timeslice_handoff_ms']['p50']:.2f} ms "
                    f"= {f['ratio_p50']:g}x slower"), "measured, not claimed", "-"])
    s = _load("scale")
    if s:
        a = s["figures"].get("many_groups")
        if a:
            w = a["acquire_wait_ms"]
            out.append([f"Scale: {a['groups']} groups x {a['jobs_per_group']} jobs, grants/s",
                        (f"{a['grants_per_s']:.0f}/s (lockd {a['lockd_cpu_ms_per_grant']:.1f} CPU-ms/grant, "
                        f"{a['etcd_revisions_per_grant']:.1f} revisions/grant, {a['error_count']} errors)"),
                        f">= {s['targets']['grants_per_s']}/s", C.verdict(a["pass"])])
            out.append([(f"Scale: {a['groups']} x {a['jobs_per_group']}, Acquire wait (queued behind "
                        f"{a['jobs_per_group'] - 1})"), f"p50 {w['p50'] / 1000:.2f} s, p99 {w['p99'] / 1000:.2f} s",
                        "-", "-"])
        b = s["figures"].get("one_group")
        if b:
            ok = b["all_granted"] and b["tokens_ascending_in_grant_order"] and b["grant_order_equals_enqueue_order"]
            out.append([f"Scale: {b['waiters']} waiters on one group, order",
                        (f"all granted: {b['all_granted']}, tokens ascending: {b['tokens_ascending_in_grant_order']}, "
                        f"order = enqueue order: {b['grant_order_equals_enqueue_order']}"),
                        "every waiter granted in order", C.verdict(ok)])
            out.append([f"Scale: {b['waiters']} waiters on one group, chain grants/s",
                        (f"{b['grants_per_s']:.0f}/s ({b['chain_s']:.1f} s; lockd {b['lockd_cpu_ms_per_grant']:.1f} "
                        f"CPU-ms/grant)"), f">= {s['targets']['grants_per_s']}/s",
                        C.verdict(b["grants_per_s"] >= s["targets"]["grants_per_s"])])
    fo = _load("failover")
    if fo:
        sm = fo["figures"]["summary"]
        for key, label in (("kill", "Failover: SIGKILL leader"), ("term", "Failover: SIGTERM leader")):
            x = sm.get(key)
            if x:
                out.append([f"{label} (lease TTL 2 s), longest grant gap",
                            (f"max {x['max_gap_s_max']:.2f} s over {x['trials']} trials "
                            f"({' / '.join(f'{g:.2f}' for g in x['max_gap_s_each'])}); lost {x['waiters_lost_total']}"),
                            f"<= {x['target_s']:g} s, none lost", C.verdict(x["pass"])])
        x = sm.get("kill_default_timings")
        if x:
            out.append(["Failover: SIGKILL leader, lockd default timings (TTL 3 s)",
                        f"max {x['max_gap_s_max']:.2f} s ({x['trials']} trial); lost {x['waiters_lost_total']}",
                        f"<= {x['target_s']:g} s (info)", C.verdict(x["pass"])])
    return out


def markdown(rs: list[list[str]]) -> str:
    lines = ["| benchmark | figure | target | |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    p.add_argument("--table-only", action="store_true", help="only print the table from existing results")
    args = p.parse_args(argv)
    timings = {}
    if not args.table_only:
        for name in args.only:
            cmd = [sys.executable, "-m", f"benchmarks.{name}", *BENCHMARKS[name]]
            print(f"\n===== {C.command_line(f'benchmarks.{name}', BENCHMARKS[name])}", flush=True)
            t = time.monotonic()
            rc = subprocess.run(cmd, cwd=C.ROOT, check=False).returncode
            timings[name] = round(time.monotonic() - t, 1)
            if rc != 0:
                print(f"benchmarks.{name} failed with exit code {rc}", file=sys.stderr)
                return rc
    rs = rows()
    print("\n===== Summary (figure beside target)")
    print(C.table(["benchmark", "figure", "target", ""], rs))
    print("  " + C.SHARED_CORES_NOTE.format(n=os.cpu_count()))
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "summary.md"), "w") as f:
        f.write(markdown(rs) + "\n")
    if timings:
        print(f"  wall time per benchmark (s): {timings}, total {sum(timings.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
