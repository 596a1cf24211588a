"""Scale: many groups cycling at once, and a thousand waiters on one group.

(a) ``--groups`` groups x ``--jobs`` jobs each (default 100 x 10 = 1,000 jobs):
    every job loops Acquire -> Yield (zero hold time) for ``--duration`` seconds
    after a warm-up; reports grants/s overall, the Acquire-wait distribution
    (client side: call to return, so it includes queueing behind the group's
    other jobs), grants per job (fairness).
(b) ``--waiters`` jobs (default 1,000) queue on ONE group: the first holds
    while the others' Acquires are issued one after another (each waits until
    its queue entry is in etcd, so the enqueue order is known), then the chain
    runs: each granted job yields at once. Checks every waiter was granted,
    tokens ascend in grant order, and grant order = enqueue order; reports
    grants/s of the chain.

Both report CPU seconds and RSS of each lockd replica, each etcd member and the
client process (/proc/<pid>/stat utime+stime deltas, statm), etcd keys under
the prefix and the revisions used (header revision delta). Jobs are spread
over the 3 replicas round-robin; all run in ONE client process with asyncio
(thousands of concurrent calls over a few shared HTTP/2 connections per
replica). Sessions are opened with ttl_seconds=--session-ttl (default 120) so
no keepalive traffic is needed during a run; keepalive load is not included.

    python -m benchmarks.scale                      # (a) then (b), defaults
    python -m benchmarks.scale --part a --duration 30
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys

from benchmarks import common as C
from benchmarks import procstats as P
from benchmarks.handoff import GroupObserver
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig

TARGET_GPS = 500


async def _open_all(jobs: list[C.Job], ttl: int, concurrency: int = 64) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(j):
        async with sem:
            await j.open(ttl=ttl)
    await asyncio.gather(*(one(j) for j in jobs))


def _jobs(st: C.Stack, names: list[str], chans: C.Channels) -> list[C.Job]:
    targets = [r.target for r in st.lockd.replicas]
    return [C.Job(n, targets, chans, home=i % len(targets), slot=i) for i, n in enumerate(names)]


def _usage_summary(usage: dict) -> dict:
    lockd = {k: v for k, v in usage.items() if k.startswith("lockd")}
    return {"lockd_cpu_s_total": round(sum(v["cpu_s"] for v in lockd.values()), 2),
            "etcd_cpu_s_total": round(sum(v["cpu_s"] for k, v in usage.items() if k.startswith("etcd")), 2)}


async def part_a(groups: int, per_group: int, duration: float, warmup: float, ttl: int,
                 spy_dir: str | None = None) -> dict:
    with C.Stack(etcd_size=1, replicas=3) as st:
        chans = C.Channels(per_target=4)
        names = [f"g{g:03d}-j{j}" for g in range(groups) for j in range(per_group)]
        jobs = _jobs(st, names, chans)
        try:
            await _open_all(jobs, ttl)
            for g in range(groups):
                await C.create_group(jobs[0], f"g{g:03d}")
            stop = asyncio.Event()
            grants: list[tuple[float, str]] = []
            waits: list[tuple[float, float]] = []
            errors: list[str] = []

            async def cycle(job: C.Job, group: str) -> None:
                while not stop.is_set():
                    t = C.now()
                    try:
                        r = await job.acquire(group, timeout=60)
                    except Exception as e:
                        if not stop.is_set():
                            errors.append(f"{job.job_id}: acquire: {e!r}"[:300])
                        return
                    t1 = C.now()
                    grants.append((t1, job.job_id))
                    waits.append((t1, (t1 - t) * 1000))
                    try:
                        await job.yield_(group, r.token)
                    except Exception as e:
                        errors.append(f"{job.job_id}: yield: {e!r}"[:300])
                        return

            keys0, _rev0 = await st.etcd_counts()
            tasks = [asyncio.create_task(cycle(j, j.job_id.split("-")[0])) for j in jobs]
            await asyncio.sleep(warmup)
            pids = st.pids()
            pids["client"] = os.getpid()
            cpu = P.CpuMeter(pids).start()
            spy = P.SpyRecorder(spy_dir and os.path.join(spy_dir, "scale-a"), pids, duration).start()
            _, rev_a = await st.etcd_counts()
            t_a = C.now()
            await asyncio.sleep(duration)
            t_b = C.now()
            _, rev_b = await st.etcd_counts()
            usage = cpu.stop()
            keys_during, _ = await st.etcd_counts()
            stop.set()
            await asyncio.to_thread(spy.wait)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await chans.close()
        in_window = [g for g in grants if t_a <= g[0] < t_b]
        n = len(in_window)
        per_job: dict[str, int] = {}
        for _, j in in_window:
            per_job[j] = per_job.get(j, 0) + 1
        counts = sorted(per_job.get(nm, 0) for nm in names)
        return {
            "groups": groups, "jobs_per_group": per_group, "duration_s": round(t_b - t_a, 2),
            "grants": n, "grants_per_s": round(n / (t_b - t_a), 1),
            "acquire_wait_ms": C.summarize([w for t, w in waits if t_a <= t < t_b]),
            "grants_per_job": {"min": counts[0], "p50": counts[len(counts) // 2], "max": counts[-1]},
            "jobs_never_granted_in_window": sum(1 for c in counts if c == 0),
            "errors": errors[:20], "error_count": len(errors),
            "etcd_keys_before": keys0, "etcd_keys_during": keys_during,
            "etcd_revisions_in_window": rev_b - rev_a,
            "etcd_revisions_per_grant": round((rev_b - rev_a) / max(n, 1), 2),
            "process": usage, **_usage_summary(usage), "machine": cpu.machine,
            "lockd_cpu_ms_per_grant": round(1000 * _usage_summary(usage)["lockd_cpu_s_total"] / max(n, 1), 3),
            "pass": n / (t_b - t_a) >= TARGET_GPS,
        }


async def part_b(waiters: int, ttl: int, spy_dir: str | None = None) -> dict:
    group = "one-group"
    with C.Stack(etcd_size=1, replicas=3) as st:
        chans = C.Channels(per_target=4)
        jobs = _jobs(st, [f"w{i:04d}" for i in range(waiters)], chans)
        cfg = EtcdConfig.parse(st.etcd.endpoints_str)
        observer = EtcdClient(cfg)
        try:
            t_open = C.now()
            await _open_all(jobs, ttl)
            open_s = C.now() - t_open
            await C.create_group(jobs[0], group)
            rev = (await observer.range(ops.range_req(st.prefix.encode(), count_only=True))).header.revision
            seen = GroupObserver(observer, f"{st.prefix}groups/{group}/".encode(), rev + 1)

            order: list[tuple[float, str, int]] = []       # grant order: (time, job, token)
            enq_tokens: dict[str, int] = {}
            errors: list[str] = []
            first = await jobs[0].acquire(group)
            order.append((C.now(), jobs[0].job_id, first.token))

            async def waiter(job: C.Job) -> None:
                try:
                    r = await job.acquire(group, timeout=300)
                    order.append((C.now(), job.job_id, r.token))
                    await job.yield_(group, r.token)
                except Exception as e:
                    errors.append(f"{job.job_id}: {e!r}"[:300])

            keys0, rev0 = await st.etcd_counts()
            t_enq = C.now()
            tasks = []
            for j in jobs[1:]:
                tasks.append(asyncio.create_task(waiter(j)))
                enq_tokens[j.job_id] = await asyncio.wait_for(seen.wait_entry(j.job_id, 0), 30)
            enqueue_s = C.now() - t_enq
            seen.close()
            keys_full, rev_full = await st.etcd_counts()
            await asyncio.sleep(1.0)                       # let every replica settle
            pids = st.pids()
            pids["client"] = os.getpid()
            cpu = P.CpuMeter(pids).start()
            spy = P.SpyRecorder(spy_dir and os.path.join(spy_dir, "scale-b"), pids, 3).start()
            t0 = C.now()
            await jobs[0].yield_(group, first.token)
            await asyncio.wait_for(asyncio.gather(*tasks), 600)
            t1 = max(t for t, _, _ in order)
            usage = cpu.stop()
            keys_end, rev_end = await st.etcd_counts()
            await asyncio.to_thread(spy.wait)
        finally:
            await observer.close()
            await chans.close()
        granted = [j for _, j, _ in sorted(order)]
        toks = [tk for _, _, tk in sorted(order)]
        expected = [j.job_id for j in jobs]
        chain = len(order) - 1
        return {
            "waiters": waiters - 1, "plus_initial_holder": 1,
            "sessions_open_s": round(open_s, 2), "enqueue_s": round(enqueue_s, 2),
            "chain_grants": chain, "chain_s": round(t1 - t0, 3), "grants_per_s": round(chain / (t1 - t0), 1),
            "all_granted": len(order) == waiters and not errors,
            "tokens_ascending_in_grant_order": all(x < y for x, y in itertools.pairwise(toks)),
            "grant_order_equals_enqueue_order": granted == expected,
            "tokens_match_enqueue_create_revisions": all(enq_tokens.get(j, tk) == tk for _, j, tk in order),
            "errors": errors[:20], "error_count": len(errors),
            "etcd_keys_before_enqueue": keys0, "etcd_keys_with_all_queued": keys_full, "etcd_keys_after": keys_end,
            "etcd_revisions_enqueue": rev_full - rev0, "etcd_revisions_chain": rev_end - rev_full,
            "etcd_revisions_per_chain_grant": round((rev_end - rev_full) / max(chain, 1), 2),
            "process": usage, **_usage_summary(usage), "machine": cpu.machine,
            "lockd_cpu_ms_per_grant": round(1000 * _usage_summary(usage)["lockd_cpu_s_total"] / max(chain, 1), 3),
            "pass": chain / (t1 - t0) >= TARGET_GPS and len(order) == waiters and granted == expected,
        }


def _machine_line(m: dict) -> str:
    return (f"  whole machine during the window: {m['machine_busy_pct_all_cores']}% of {m['cores']} cores busy; "
            f"the processes above: {m['measured_processes_cpu_pct_of_all_cores']}%; "
            f"load average {m['loadavg_1min_start_end'][0]:.1f} -> {m['loadavg_1min_start_end'][1]:.1f}")


def _proc_rows(usage: dict) -> list[list]:
    return [[k, v["cpu_s"], v["cpu_pct_of_one_core"], v["rss_mb"]] for k, v in usage.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--jobs", type=int, default=10, help="jobs per group in (a)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds of (a)")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before (a)'s window")
    p.add_argument("--waiters", type=int, default=1000, help="jobs queued on one group in (b), holder included")
    p.add_argument("--session-ttl", type=int, default=120)
    p.add_argument("--py-spy", metavar="DIR", default=None,
                   help="record py-spy profiles of every process during the measured window into DIR")
    args = p.parse_args(argv)
    figures = {}
    if args.part in ("a", "both"):
        figures["many_groups"] = a = asyncio.run(part_a(args.groups, args.jobs, args.duration, args.warmup,
                                                        args.session_ttl, args.py_spy))
        print(f"(a) {a['groups']} groups x {a['jobs_per_group']} jobs, acquire/yield loop, "
              f"{a['duration_s']} s window")
        w = a["acquire_wait_ms"]
        print(C.table(["grants/s", "target", "", "wait p50 ms", "wait p99 ms", "wait max ms", "grants/job min-max",
                       "revs/grant", "lockd CPU ms/grant", "errors"],
                      [[a["grants_per_s"], f">= {TARGET_GPS}", C.verdict(a["pass"]), w.get("p50"), w.get("p99"),
                        w.get("max"), f"{a['grants_per_job']['min']}-{a['grants_per_job']['max']}",
                        a["etcd_revisions_per_grant"], a["lockd_cpu_ms_per_grant"], a["error_count"]]]))
        print(C.table(["process", "CPU s", "% of one core", "RSS MB"], _proc_rows(a["process"])))
        print(_machine_line(a["machine"]))
        print(f"  etcd keys: {a['etcd_keys_before']} before, {a['etcd_keys_during']} during; "
              f"revisions in window: {a['etcd_revisions_in_window']}")
    if args.part in ("b", "both"):
        figures["one_group"] = b = asyncio.run(part_b(args.waiters, args.session_ttl, args.py_spy))
        print(f"(b) {b['waiters']} Acquires waiting on one group, then the holder chain")
        print(C.table(["grants/s", "target", "", "chain s", "all granted", "FIFO (tokens)", "FIFO (enqueue order)",
                       "revs/grant", "lockd CPU ms/grant"],
                      [[b["grants_per_s"], f">= {TARGET_GPS}", C.verdict(b["pass"]), b["chain_s"], b["all_granted"],
                        b["tokens_ascending_in_grant_order"], b["grant_order_equals_enqueue_order"],
                        b["etcd_revisions_per_chain_grant"], b["lockd_cpu_ms_per_grant"]]]))
        print(C.table(["process", "CPU s", "% of one core", "RSS MB"], _proc_rows(b["process"])))
        print(_machine_line(b["machine"]))
        print(f"  sessions opened in {b['sessions_open_s']} s, enqueued one by one in {b['enqueue_s']} s; "
              f"etcd keys: {b['etcd_keys_before_enqueue']} -> {b['etcd_keys_with_all_queued']} -> "
              f"{b['etcd_keys_after']}; revisions: enqueue {b['etcd_revisions_enqueue']}, "
              f"chain {b['etcd_revisions_chain']}")
    print("  " + C.SHARED_CORES_NOTE.format(n=os.cpu_count()))
    path = C.write_result("scale", C.command_line("benchmarks.scale", argv), vars(args), figures,
                          targets={"grants_per_s": TARGET_GPS}, lockd_flags="defaults",
                          client="one process, asyncio, 4 HTTP/2 connections per lockd replica")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
