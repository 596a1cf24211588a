"""Failover blackout: kill (SIGKILL) or stop (SIGTERM) the lockd leader during a ping-pong.

Two jobs loop Acquire -> hold 2 ms -> Yield on one group, so grants alternate
~every handoff. Job A's client is on the leader, B's on a follower; both fail
over on UNAVAILABLE by re-sending the same call to the next replica (Acquire is
idempotent, Yield carries its token; a re-sent Yield answered ``not_queued``
means the first one was applied). After ``--before`` seconds the leader is
SIGKILLed (or SIGTERMed: graceful stop, which resigns first); the loop goes on
for ``--after`` seconds. Reported per trial: the longest gap between
consecutive grants (client-observed Acquire returns), the time from the fault
to the first grant after it, re-sent calls, and whether any waiter was lost
(every Acquire issued must return granted; none may fail). Tokens must ascend
in grant order across both jobs (no double grant). The downed replica is
restarted between trials, so every trial runs against 3 replicas.

The main trials run lockd with shorter election timings (passed as flags):
    --lease-ttl 2 --renew-deadline 1.5 --retry-period 0.5
since the default leader lease TTL (5 s) alone exceeds the 3 s target after a
SIGKILL. ``--default-trials`` adds SIGKILL trials with lockd's default timings
(informational).

    python -m benchmarks.failover                   # 3 x SIGKILL, 3 x SIGTERM, 1 x SIGKILL default timings
    python -m benchmarks.failover --repeats 5 --default-trials 0

Stalls and etcd member loss, ``--stall-trials N`` (0 skips them): the
same ping-pong, but the jobs use the product's client (``AsyncOrchestratorClient``:
keepalive pings, numbered Acquire attempts), since what is measured is what a job
sees. Rows: SIGSTOP of the leader replica for 5 s and for 30 s (then SIGCONT), and
SIGKILL of the etcd member the replicas talk to (the first endpoint: gRPC's
pick_first) while it is the raft leader, and while it is a follower (leadership is
moved with ``etcdctl move-leader`` first); these run on a 3-member etcd. Target for
every row: longest grant gap <= 3 s, as for a replica SIGKILL.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time

import grpc

from benchmarks import common as C
from timeslice import AsyncOrchestratorClient
from timeslice.errors import TimesliceClientError

GROUP = "bench-failover"
FAST_FLAGS = ["--lease-ttl", "2", "--renew-deadline", "1.5", "--retry-period", "0.5"]
TARGET = {"kill": 3.0, "term": 0.5, "pause5": 3.0, "pause30": 3.0, "etcd-leader": 3.0, "etcd-follower": 3.0}
LABEL = {"kill": "SIGKILL", "term": "SIGTERM (graceful)", "pause5": "SIGSTOP leader 5 s",
         "pause30": "SIGSTOP leader 30 s", "etcd-leader": "SIGKILL etcd member (raft leader)",
         "etcd-follower": "SIGKILL etcd member (follower)"}
FAILED = (grpc.aio.AioRpcError, C.GiveUp, TimesliceClientError)


def _code(e: BaseException) -> str:
    code = getattr(e, "code", "")
    return str(code() if callable(code) else code)


class LibJob:
    """A job on the product's client, behind PingPong's interface."""

    def __init__(self, job_id: str, targets: list[str]):
        self.job_id = job_id
        self.c = AsyncOrchestratorClient(targets, job_id=job_id, release_cache=False)

    async def open(self) -> None:
        await self.c.open_session()

    async def acquire(self, group: str, timeout: float):
        return await self.c.acquire(group, timeout=timeout)

    async def yield_(self, group: str, token: int):
        return await self.c.yield_(group, token)

    async def close(self) -> None:
        await self.c.close()


class PingPong:
    """Two jobs looping Acquire/Yield on one group; records every grant."""

    def __init__(self, jobs: list[C.Job], hold_s: float = 0.002):
        self.jobs, self.hold_s = jobs, hold_s
        self.grants: list[tuple[float, str, int]] = []
        self.issued = {j.job_id: 0 for j in jobs}
        self.granted = {j.job_id: 0 for j in jobs}
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(j)) for j in self.jobs]

    async def _loop(self, job: C.Job) -> None:
        while not self.stop.is_set():
            self.issued[job.job_id] += 1
            try:
                r = await job.acquire(GROUP, timeout=30)
            except FAILED as e:
                self.errors.append(f"{job.job_id} Acquire: {_code(e)} {e}"[:300])
                return
            self.granted[job.job_id] += 1
            self.grants.append((C.now(), job.job_id, r.token))
            await asyncio.sleep(self.hold_s)
            try:
                await job.yield_(GROUP, r.token)
            except FAILED as e:
                self.errors.append(f"{job.job_id} Yield: {_code(e)} {e}"[:300])
                return

    async def finish(self, timeout: float = 40.0) -> bool:
        """Stop after the current cycles; True if every loop ended by itself in time."""
        self.stop.set()
        _done, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        return not pending


async def trial(st: C.Stack, kind: str, n: int, before: float, after: float) -> dict:
    lead, followers = st.roles()
    targets = [lead.target] + [f.target for f in followers]
    a = C.Job(f"fo-a-{kind}{n}", targets, C.Channels(), home=0)                # on the leader
    b = C.Job(f"fo-b-{kind}{n}", targets, C.Channels(), home=1)                # on a follower
    await asyncio.gather(a.open(), b.open())
    keep = [asyncio.create_task(j.keepalive_loop(3.0)) for j in (a, b)]
    pp = PingPong([a, b])
    try:
        pp.start()
        await asyncio.sleep(before)
        t_fault = C.now()
        if kind == "kill":
            await asyncio.to_thread(lead.kill)
        else:
            await asyncio.to_thread(lead.stop)        # SIGTERM; returns once the process has exited
        t_down = C.now()
        await asyncio.sleep(max(0.0, after - (t_down - t_fault)))
        ended = await pp.finish()
    finally:
        for t in keep:
            t.cancel()
        for j in (a, b):
            await j.close_session()
            await j.channels.close()
    res = figures(pp, kind, t_fault, t_down, ended, lead.replica_id)
    res["resent_calls"] = a.resends + b.resends
    # Bring the replica back so the next trial has 3 again.
    await asyncio.to_thread(lead.start)
    await asyncio.to_thread(st.lockd.leader, st.etcd)
    await asyncio.sleep(0.5)
    return res


def figures(pp: PingPong, kind: str, t_fault: float, t_down: float, ended: bool, victim: str) -> dict:
    times = [t for t, _, _ in pp.grants]
    toks = [tk for _, _, tk in sorted(pp.grants)]
    gaps = [(t2 - t1, t1) for t1, t2 in itertools.pairwise(times)]
    max_gap, at = max(gaps) if gaps else (float("nan"), 0.0)
    normal = [g for g, t in gaps if t < t_fault]
    after_fault = [t for t in times if t > t_fault]
    lost = sum(pp.issued.values()) - sum(pp.granted.values())
    res = {
        "kind": LABEL[kind],
        "loadavg_1min": os.getloadavg()[0],
        "victim": victim,
        "max_gap_s": round(max_gap, 3),
        "max_gap_starts_s_after_fault": round(at - t_fault, 3),
        "fault_to_first_grant_s": round(after_fault[0] - t_fault, 3) if after_fault else None,
        "signal_to_process_gone_s": round(t_down - t_fault, 3),
        "normal_gap_ms_p50": round(1000 * sorted(normal)[len(normal) // 2], 2) if normal else None,
        "grants": len(times), "grants_after_fault": len(after_fault),
        "acquires_issued": sum(pp.issued.values()), "acquires_granted": sum(pp.granted.values()),
        "waiters_lost": lost, "loops_ended_cleanly": ended, "errors": pp.errors,
        "tokens_ascending": all(x < y for x, y in itertools.pairwise(toks)),
    }
    res["pass"] = (res["max_gap_s"] <= TARGET[kind] and lost == 0 and not pp.errors and ended
                   and res["tokens_ascending"])
    return res


def etcd_member_in_role(etcd, leader: bool):
    """The member lockd talks to (its first endpoint), made raft leader or follower first."""
    m0 = etcd.members[0]
    for _ in range(10):
        lead = etcd.leader()
        if (lead is m0) == leader:
            return m0
        to = m0 if leader else etcd.members[1]
        etcd.etcdctl("move-leader", format(int(to.status()["header"]["member_id"]), "x"),
                     endpoints=[lead.endpoint])
        time.sleep(0.3)
    raise RuntimeError("could not put the raft leadership where the trial needs it")


async def stall_trial(st: C.Stack, kind: str, n: int, before: float, after: float) -> dict:
    """A pause of the leader replica or the loss of an etcd member, under library clients."""
    lead, followers = st.roles()
    a = LibJob(f"fo-a-{kind}{n}", [lead.target] + [f.target for f in followers])         # on the leader
    b = LibJob(f"fo-b-{kind}{n}", [followers[0].target, lead.target] + [f.target for f in followers[1:]])
    await asyncio.gather(a.open(), b.open())
    victim_name = lead.replica_id
    if kind.startswith("etcd"):
        member = await asyncio.to_thread(etcd_member_in_role, st.etcd, kind == "etcd-leader")
        victim_name = f"etcd {member.name}"
        await asyncio.sleep(0.5)
    pp = PingPong([a, b])
    try:
        pp.start()
        await asyncio.sleep(before)
        t_fault = C.now()
        if kind.startswith("pause"):
            await asyncio.to_thread(lead.pause)
            await asyncio.sleep(int(kind[5:]))
            await asyncio.to_thread(lead.resume)
        else:
            await asyncio.to_thread(member.kill)
        t_down = C.now()
        await asyncio.sleep(after)
        ended = await pp.finish()
    finally:
        for j in (a, b):
            await j.close()
    res = figures(pp, kind, t_fault, t_down, ended, victim_name)
    if kind.startswith("etcd"):
        await asyncio.to_thread(member.restart)
        await st.etcd.wait_healthy_async(30)
    await asyncio.to_thread(st.lockd.leader, st.etcd)
    await asyncio.sleep(0.5)
    return res


async def run(kinds: list[str], repeats: int, before: float, after: float, flags: list[str],
              etcd_members: int) -> list[dict]:
    out = []
    with C.Stack(etcd_size=etcd_members, replicas=3, lockd_args=flags) as st:
        setup = C.Job("fo-setup", [st.lockd.replicas[0].target], C.Channels())
        await C.create_group(setup, GROUP)
        await setup.channels.close()
        for kind in kinds:
            for i in range(repeats):
                if kind in ("kill", "term"):
                    r = await trial(st, kind, i, before, after)
                else:
                    r = await stall_trial(st, kind, i, before, after)
                r["lockd_flags"] = " ".join(flags) or "defaults"
                out.append(r)
                print(f"  {r['kind']:<18} trial {i + 1}: max gap {r['max_gap_s']:.3f} s, first grant after "
                      f"{r['fault_to_first_grant_s']} s, lost {r['waiters_lost']}, errors {len(r['errors'])}, "
                      f"re-sent {len(r['resent_calls'])}", flush=True)
    return out


async def run_stalls(counts: dict[str, int], before: float, after: float) -> list[dict]:
    """The stall and etcd-member rows, on a 3-member etcd (the etcd rows need one)."""
    out = []
    with C.Stack(etcd_size=3, replicas=3, lockd_args=FAST_FLAGS) as st:
        setup = C.Job("fo-setup", [st.lockd.replicas[0].target], C.Channels())
        await C.create_group(setup, GROUP)
        await setup.channels.close()
        for kind, n in counts.items():
            for i in range(n):
                r = await stall_trial(st, kind, i, before, after)
                r["lockd_flags"] = " ".join(FAST_FLAGS)
                out.append(r)
                print(f"  {r['kind']:<34} trial {i + 1}: max gap {r['max_gap_s']:.3f} s, first grant after "
                      f"{r['fault_to_first_grant_s']} s, lost {r['waiters_lost']}, errors {len(r['errors'])}",
                      flush=True)
    return out


def summarize_kind(ts: list[dict], target: float) -> dict:
    return {"trials": len(ts), "max_gap_s_each": [t["max_gap_s"] for t in ts],
            "max_gap_s_max": max(t["max_gap_s"] for t in ts),
            "waiters_lost_total": sum(t["waiters_lost"] for t in ts),
            "errors_total": sum(len(t["errors"]) for t in ts),
            "target_s": target, "pass": all(t["pass"] for t in ts)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.failover", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="trials per kind (SIGKILL, SIGTERM); 0 skips them")
    p.add_argument("--before", type=float, default=1.0, help="seconds of ping-pong before the fault")
    p.add_argument("--after", type=float, default=4.0, help="seconds of ping-pong after the fault")
    p.add_argument("--default-trials", type=int, default=1,
                   help="extra SIGKILL trials with lockd's default timings (informational)")
    p.add_argument("--etcd-members", type=int, default=1)
    p.add_argument("--stall-trials", type=int, default=2,
                   help="trials of each stall row (leader SIGSTOP 5 s, etcd raft leader / follower SIGKILL)")
    p.add_argument("--long-pause-trials", type=int, default=1, help="trials of the leader SIGSTOP 30 s row")
    p.add_argument("--result-name", default="failover", help="benchmarks/results/<name>.json")
    args = p.parse_args(argv)
    print(f"lockd flags for the main trials: {' '.join(FAST_FLAGS)}")
    trials = []
    if args.repeats:
        trials = asyncio.run(run(["kill", "term"], args.repeats, args.before, args.after, FAST_FLAGS,
                                 args.etcd_members))
    counts = {"pause5": args.stall_trials, "pause30": args.long_pause_trials,
              "etcd-leader": args.stall_trials, "etcd-follower": args.stall_trials}
    counts = {k: n for k, n in counts.items() if n > 0}
    stalls = asyncio.run(run_stalls(counts, args.before, args.after)) if counts else []
    default = []
    if args.default_trials:
        print("lockd default timings (lease TTL 3 s, renew deadline 2 s, retry period 0.5 s):")
        default = asyncio.run(run(["kill"], args.default_trials, args.before, 8.0, [], args.etcd_members))
    summary = {}
    for kind in ("kill", "term", *counts):
        ts = [t for t in trials + stalls if t["kind"] == LABEL[kind]]
        if ts:
            summary[kind] = summarize_kind(ts, TARGET[kind])
    if default:
        summary["kill_default_timings"] = summarize_kind(default, TARGET["kill"])
    rows = []
    names = {"kill": "SIGKILL leader", "term": "SIGTERM leader", "kill_default_timings": "SIGKILL, default timings"}
    for key, s in summary.items():
        label = names.get(key) or LABEL[key] + " (library client)"
        rows.append([label, " / ".join(f"{g:.2f}" for g in s["max_gap_s_each"]), s["max_gap_s_max"],
                     f"<= {s['target_s']}", s["waiters_lost_total"], s["errors_total"], C.verdict(s["pass"])])
    print(C.table(["fault", "longest grant gap per trial (s)", "max s", "target", "lost", "errors", ""], rows))
    print("  " + C.SHARED_CORES_NOTE.format(n=os.cpu_count()))
    path = C.write_result(args.result_name, C.command_line("benchmarks.failover", argv), vars(args),
                          {"summary": summary, "trials": trials, "stall_trials": stalls,
                           "default_timing_trials": default},
                          targets={"sigkill_gap_s": TARGET["kill"], "sigterm_gap_s": TARGET["term"],
                                   "stall_gap_s": TARGET["pause5"], "waiters_lost": 0},
                          lockd_flags=" ".join(FAST_FLAGS) + " (main and stall trials); defaults "
                          "(default_timing_trials)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
