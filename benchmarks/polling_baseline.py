"""Baseline: the same ping-pong through an orchestrator that polls its state once per second.

The reference implementation decides grants in a loop that looks at its state
once per second. ``PollingOrchestrator`` does exactly that and nothing more: a
gRPC server speaking the same lockd API (so the very same client code and
handoff loop drive it), state in memory (no etcd at all, which only flatters
it), and a poll loop that grants the head of each free queue once per period.
A Yield only marks the group free; the waiter is granted at the next poll.

A closed ping-pong would synchronise itself to the poll (every Yield would come
just after a poll and wait a whole period), so each Yield is issued at a random
phase of the poll (a uniform delay in [0, period) before it): the measured
handoff is then what a job yielding at an arbitrary moment sees, ~period/2 on
average. In the same run, the same loop measures timeslice (3 lockd replicas, 1
etcd member) so the ratio compares like with like.

    python -m benchmarks.polling_baseline                 # 20 polling handoffs, 200 timeslice
    python -m benchmarks.polling_baseline serve --period 1.0   # just the server (prints POLLING_READY port=N)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import subprocess
import sys
import time
from collections import deque

import grpc

from benchmarks import common as C
from benchmarks.handoff import one_handoff
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

GROUP = "bench-polling"


class PollingOrchestrator(pbg.LockdServicer):
    """A minimal 1 Hz polling lock: grants happen only when ``poll()`` runs."""

    def __init__(self, period: float):
        self.period = period
        self.secrets: dict[str, str] = {}
        self.groups: dict[str, deque] = {}                   # group -> queue of (job, token)
        self.holder: dict[str, tuple[str, int] | None] = {}
        self.granted: dict[tuple[str, str], asyncio.Future] = {}
        self.next_token = 1
        self.polls = 0

    def _check(self, job: str, secret: str, context) -> None:
        if self.secrets.get(job) != secret:
            raise PermissionError(job)

    async def OpenSession(self, req, context):
        s = self.secrets[req.job_id] = secrets.token_urlsafe(16)
        return pb.OpenSessionReply(job_id=req.job_id, session_secret=s, ttl_seconds=req.ttl_seconds or 10)

    async def KeepAlive(self, req, context):
        return pb.KeepAliveReply(ttl_seconds=10)

    async def CloseSession(self, req, context):
        return pb.CloseSessionReply(closed=self.secrets.pop(req.job_id, None) is not None)

    async def CreateGroup(self, req, context):
        self.groups.setdefault(req.group_id, deque())
        self.holder.setdefault(req.group_id, None)
        return pb.Group(group_id=req.group_id, nodes=req.nodes)

    async def Acquire(self, req, context):
        t0 = time.monotonic()
        self._check(req.job_id, req.session_secret, context)
        g, j = req.group_id, req.job_id
        h = self.holder.get(g)
        if h is not None and h[0] == j:
            return pb.AcquireReply(group_id=g, job_id=j, token=h[1])
        fut = self.granted.get((g, j))
        if fut is None:
            fut = self.granted[(g, j)] = asyncio.get_running_loop().create_future()
            self.groups[g].append(j)
        token = await fut
        return pb.AcquireReply(group_id=g, job_id=j, token=token, waited_ms=(time.monotonic() - t0) * 1000)

    async def Yield(self, req, context):
        self._check(req.job_id, req.session_secret, context)
        h = self.holder.get(req.group_id)
        if h is None or h != (req.job_id, req.token):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not_queued: not the holder")
        self.holder[req.group_id] = None          # the next grant waits for the next poll
        return pb.YieldReply(released=True, deferred_snapshot=not self.groups[req.group_id])

    async def GetGroupStatus(self, req, context):
        g = req.group_id
        st = pb.GroupStatus(group_id=g)
        h = self.holder.get(g)
        if h is not None:
            st.holder.CopyFrom(pb.Waiter(job_id=h[0], token=h[1]))
        # A waiter's token is assigned at grant time here; report one above any so far.
        st.waiters.extend(pb.Waiter(job_id=j, token=self.next_token) for j in self.groups.get(g, ()))
        return st

    def poll(self) -> None:
        self.polls += 1
        for g, q in self.groups.items():
            if self.holder[g] is None and q:
                j = q.popleft()
                tok, self.next_token = self.next_token, self.next_token + 1
                self.holder[g] = (j, tok)
                self.granted.pop((g, j)).set_result(tok)

    async def poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.period - (time.monotonic() % self.period))
            self.poll()


async def serve(period: float, port: int = 0) -> None:
    orch = PollingOrchestrator(period)
    server = grpc.aio.server()
    pbg.add_LockdServicer_to_server(orch, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"POLLING_READY port={bound}", flush=True)
    task = asyncio.create_task(orch.poll_loop())
    try:
        await server.wait_for_termination()
    finally:
        task.cancel()


def start_server(period: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.polling_baseline", "serve", "--period", str(period)],
                            stdout=subprocess.PIPE, text=True, cwd=C.ROOT, start_new_session=True)
    line = proc.stdout.readline()
    if not line.startswith("POLLING_READY"):
        proc.kill()
        raise RuntimeError(f"polling server did not start: {line!r}")
    return proc, f"127.0.0.1:{line.split('port=')[1].strip()}"


async def pingpong(a: C.Job, b: C.Job, group: str, n: int, settle_s: float, phase: float | None,
                   rng: random.Random) -> list[float]:
    holder, waiter = a, b
    token = (await holder.acquire(group)).token
    out = []
    for _ in range(n):
        delay = (lambda: asyncio.sleep(rng.uniform(0, phase))) if phase else None
        ms, reply, _, _ = await one_handoff(holder, waiter, group, token, settle_s, pre_yield=delay)
        out.append(ms)
        token, holder, waiter = reply.token, waiter, holder
    await holder.yield_(group, token)
    return out


async def measure_polling(period: float, n: int, rng: random.Random) -> list[float]:
    proc, target = start_server(period)
    chans = C.Channels()
    try:
        a, b = C.Job("poll-a", [target], chans), C.Job("poll-b", [target], C.Channels())
        await asyncio.gather(a.open(), b.open())
        await C.create_group(a, GROUP)
        return await pingpong(a, b, GROUP, n, 0.002, period, rng)
    finally:
        await chans.close()
        proc.terminate()
        proc.wait(10)


async def measure_timeslice(n: int, rng: random.Random) -> list[float]:
    with C.Stack(etcd_size=1, replicas=3) as st:
        lead, followers = st.roles()
        a = C.Job("ts-a", [lead.target], C.Channels())
        b = C.Job("ts-b", [followers[0].target], C.Channels())
        await asyncio.gather(a.open(), b.open())
        keep = [asyncio.create_task(j.keepalive_loop(3.0)) for j in (a, b)]
        try:
            await C.create_group(a, GROUP)
            await pingpong(a, b, GROUP, 20, 0.002, None, rng)          # warm-up
            return await pingpong(a, b, GROUP, n, 0.002, None, rng)
        finally:
            for t in keep:
                t.cancel()
            await asyncio.gather(a.channels.close(), b.channels.close())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.polling_baseline", description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", choices=["bench", "serve"], default="bench")
    p.add_argument("--period", type=float, default=1.0, help="poll period of the baseline, s")
    p.add_argument("--handoffs", type=int, default=20, help="handoffs through the polling orchestrator")
    p.add_argument("--timeslice-handoffs", type=int, default=200, help="handoffs through timeslice, same loop")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.mode == "serve":
        asyncio.run(serve(args.period))
        return 0
    rng = random.Random(args.seed)
    poll = C.summarize(asyncio.run(measure_polling(args.period, args.handoffs, rng)))
    ts = C.summarize(asyncio.run(measure_timeslice(args.timeslice_handoffs, rng)))
    ratio = round(poll["p50"] / ts["p50"], 1)
    print(f"Polling baseline ({args.period:g} s poll) vs timeslice: handoff, same client loop")
    print(C.table(["orchestrator", "n", "p50 ms", "p99 ms", "max ms", "mean ms"],
                  [[f"polling {args.period:g} s", poll["n"], poll["p50"], poll["p99"], poll["max"], poll["mean"]],
                   ["timeslice (3 lockd, 1 etcd)", ts["n"], ts["p50"], ts["p99"], ts["max"], ts["mean"]]]))
    print(f"  ratio p50 polling / timeslice = {ratio}x")
    print("  " + C.SHARED_CORES_NOTE.format(n=os.cpu_count()))
    path = C.write_result("polling_baseline", C.command_line("benchmarks.polling_baseline", argv), vars(args),
                          {"polling_handoff_ms": poll, "timeslice_handoff_ms": ts, "ratio_p50": ratio},
                          method="each Yield issued at a uniform random phase of the poll; "
                                 "the polling server keeps its state in memory (no etcd)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
