"""Handoff latency: Yield of A -> Acquire of B returns, nothing to move, beside the raw etcd floor.

Two jobs ping-pong on one group whose node runs no agent and has no workers,
so no swap is ever needed: a handoff is the Yield RPC, lockd's release
transaction, the leader seeing it through its watch, the leader's grant
transaction, B's replica seeing the grant through its watch, and B's reply.
The jobs' clients sit on different lockd replicas: A on the leader, B on a
follower (so half the handoffs grant to a follower's client, half to the
leader's). Before each handoff the benchmark polls B's replica
(GetGroupStatus) until B shows there as a waiter, i.e. B's Acquire handler has
enqueued and is waiting, then pauses ``--settle-ms``; B's server-side
``waited_ms`` is checked afterwards to prove B was blocked before A yielded.

The floor is measured in the same run, in blocks alternating with the handoff
blocks (so background load on the machine hits both alike): one etcd
transaction (a put) by one client connection, and the delivery of the watch
event it causes to a watcher on another connection, both through timeslice.common's etcd
layer, against the same endpoints lockd uses. Each floor sample follows the
same settle pause as each handoff (both start from a quiet system).

``--phases`` adds a third etcd watcher on the group that timestamps the
release (queue entry deleted) and the grant (grant put) as an outside
observer sees them, splitting each handoff into its stages.

    python -m benchmarks.handoff                   # 1 and 3 etcd members, 2000 handoffs each
    python -m benchmarks.handoff --members 3 --handoffs 500
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys

from benchmarks import common as C
from benchmarks import procstats as P
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig
from timeslice.common.server.etcd.watch import Watch
from timeslice.proto import lockd_pb2 as pb

GROUP = "bench-handoff"
TARGET_RATIO, TARGET_P99_MS = 3.0, 25.0


class GroupObserver:
    """An independent etcd watch on the group's keys, for the precondition and the breakdown.

    It tells when a job's (new) queue entry exists (so B is enqueued before A
    yields) and when a queue entry's delete and a grant's put reached an
    outside watcher (so a handoff splits into: release committed, grant
    committed, grant delivered to B).
    """

    def __init__(self, client: EtcdClient, group_prefix: bytes, start_revision: int):
        self.created: dict[str, int] = {}          # job -> create_revision of its latest entry
        self.deleted_at: dict[int, float] = {}     # token -> when its queue entry's delete arrived
        self.granted_at: dict[int, float] = {}     # token -> when its grant's put arrived
        self._changed = asyncio.Event()
        self._watch = Watch(client, group_prefix, prefix=True, start_revision=start_revision, prev_kv=True)
        self._queue = group_prefix + b"queue/"
        self._grant = group_prefix + b"grant"
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for batch in self._watch:
            t = C.now()
            for ev in batch:
                key = ev.kv.key
                if key.startswith(self._queue):
                    if ev.is_put:
                        self.created[key[len(self._queue):].decode()] = ev.kv.create_revision
                    elif ev.prev_kv is not None:
                        self.deleted_at[ev.prev_kv.create_revision] = t
                elif key == self._grant and ev.is_put:
                    self.granted_at[json.loads(ev.kv.value)["token"]] = t
            self._changed.set()

    async def wait_entry(self, job: str, newer_than: int) -> int:
        """Wait until ``job`` has a queue entry created after revision ``newer_than``."""
        while self.created.get(job, 0) <= newer_than:
            self._changed.clear()
            await self._changed.wait()
        return self.created[job]

    async def wait_seen(self, table: dict, token: int, timeout: float = 5.0) -> float | None:
        end = C.now() + timeout
        while token not in table and C.now() < end:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, end - C.now()))
            except asyncio.TimeoutError:
                break
        return table.get(token)

    def close(self) -> None:
        self._watch.close()
        self._task.cancel()


async def _floor_block(writer: EtcdClient, key: bytes, got: asyncio.Queue, n: int, settle_s: float) -> list[float]:
    """``n`` floor samples, each after the same settle pause a handoff gets before its Yield."""
    out = []
    for i in range(n):
        await asyncio.sleep(settle_s)
        t0 = C.now()
        await writer.txn([], [ops.put(key, b"v%d" % i)])
        t1 = await got.get()
        out.append((t1 - t0) * 1000)
    return out


async def _wait_blocked(job: C.Job, group: str, newer_than: int, timeout: float = 10.0) -> None:
    """Until ``job`` shows as a waiter (token > ``newer_than``) in its own replica's mirror.

    The replica's mirror holding the entry means that replica's Acquire handler
    has passed its enqueue and is waiting for the grant: B is blocked.
    """
    stub = job.channels.stub(job.target)
    end = C.now() + timeout
    while C.now() < end:
        st = await stub.GetGroupStatus(pb.GroupRef(group_id=group), timeout=timeout)
        if any(w.job_id == job.job_id and w.token > newer_than for w in st.waiters):
            return
        await asyncio.sleep(0.0005)
    raise TimeoutError(f"{job.job_id} never showed as a waiter of {group}")


async def one_handoff(holder: C.Job, waiter: C.Job, group: str, token: int, settle_s: float,
                      pre_yield=None):
    """One handoff: start ``waiter``'s Acquire, wait until it is blocked, settle, then ``holder``
    yields ``token``. Returns (ms from the Yield call to the Acquire's return, reply, t0, t_yield_returned).

    ``pre_yield`` (an awaitable factory) runs between the settle and the Yield (the polling
    baseline uses it to land the Yield at a random phase of its poll).
    """
    w_task = asyncio.create_task(_timed(waiter.acquire(group)))
    try:
        await _wait_blocked(waiter, group, token)
        await asyncio.sleep(settle_s)
        if pre_yield is not None:
            await pre_yield()
        t0 = C.now()
        await holder.yield_(group, token)
        t_y = C.now()
        reply, t1 = await w_task
    except BaseException:
        w_task.cancel()
        raise
    return (t1 - t0) * 1000, reply, t0, t_y


async def run_members(members: int, handoffs: int, block: int, settle_ms: float, warmup: int,
                      phases_on: bool = False) -> dict:
    with C.Stack(etcd_size=members, replicas=3) as st:
        lead, followers = st.roles()
        etcd_leader = st.etcd.leader().name
        cfg = EtcdConfig.parse(st.etcd.endpoints_str)
        writer, watcher, observer = EtcdClient(cfg), EtcdClient(cfg), EtcdClient(cfg)
        a = C.Job("bench-a", [lead.target], C.Channels())
        b = C.Job("bench-b", [followers[0].target], C.Channels())
        try:
            await asyncio.gather(a.open(), b.open())
            keep = [asyncio.create_task(j.keepalive_loop(3.0)) for j in (a, b)]   # default TTL 10 s
            await C.create_group(a, GROUP)
            rev = (await writer.range(ops.range_req(st.prefix.encode(), count_only=True))).header.revision
            # Off by default: an extra watcher woken in the middle of every handoff
            # competes for the same 2 cores, so the headline figures run without it.
            seen = GroupObserver(observer, f"{st.prefix}groups/{GROUP}/".encode(), rev + 1) if phases_on else None

            # The floor: a watcher on its own connection, fed to a queue with the arrival time.
            fkey = f"{st.prefix}floor/k".encode()
            got: asyncio.Queue = asyncio.Queue()
            fwatch = Watch(watcher, fkey, start_revision=rev + 1)

            async def feed():
                async for _batch in fwatch:
                    got.put_nowait(C.now())
            ftask = asyncio.create_task(feed())

            cpu = P.CpuMeter({**st.pids(), "client": C.os.getpid()}).start()
            holder, waiter = a, b
            token = (await holder.acquire(GROUP)).token
            hand, floor, direction, not_blocked, tokens, waited_ms = [], [], [], 0, [token], []
            phases = {k: [] for k in ("yield_rpc_returned", "release_seen_by_watcher", "grant_seen_by_watcher")}
            await _floor_block(writer, fkey, got, warmup, settle_ms / 1000)        # warm both paths up
            total = handoffs + warmup
            done = 0
            while done < total:
                for _ in range(min(block, total - done)):
                    ms, reply, t0, t_y = await one_handoff(holder, waiter, GROUP, token, settle_ms / 1000)
                    if done >= warmup and seen is not None:
                        t_rel = await seen.wait_seen(seen.deleted_at, token)
                        t_gr = await seen.wait_seen(seen.granted_at, reply.token)
                        phases["yield_rpc_returned"].append((t_y - t0) * 1000)
                        if t_rel and t_gr:
                            phases["release_seen_by_watcher"].append((t_rel - t0) * 1000)
                            phases["grant_seen_by_watcher"].append((t_gr - t0) * 1000)
                    if done >= warmup:
                        hand.append(ms)
                        direction.append("to_follower" if waiter is b else "to_leader")
                        waited_ms.append(reply.waited_ms)
                        # B was blocked >= settle_ms before A's Yield, so lockd must report at
                        # least that long a wait; less would mean B was not blocked yet.
                        if reply.waited_ms < settle_ms:
                            not_blocked += 1
                    tokens.append(reply.token)
                    token = reply.token
                    holder, waiter = waiter, holder
                    done += 1
                floor += await _floor_block(writer, fkey, got, min(block, max(0, len(hand) - len(floor))),
                                            settle_ms / 1000)
            if len(floor) < len(hand):
                floor += await _floor_block(writer, fkey, got, len(hand) - len(floor), settle_ms / 1000)
            usage = cpu.stop()
            await holder.yield_(GROUP, token)
            if seen is not None:
                seen.close()
            for t in keep:
                t.cancel()
            fwatch.close()
            ftask.cancel()
        finally:
            for c in (writer, watcher, observer):
                await c.close()
            await asyncio.gather(a.channels.close(), b.channels.close())
        hs, fs = C.summarize(hand), C.summarize(floor)
        by_dir = {d: C.summarize([h for h, dd in zip(hand, direction) if dd == d])
                  for d in ("to_follower", "to_leader")}
        return {
            "etcd_members": members,
            "etcd_raft_leader": etcd_leader,
            "lockd_endpoint_note": "lockd and the floor clients dial the same etcd endpoint list (gRPC pick_first)",
            "handoff_ms": hs,
            "handoff_ms_by_direction": by_dir,
            "handoff_phases_ms_since_yield_call": ({k: C.summarize(v) for k, v in phases.items()}
                                                   if phases_on else "not measured (run with --phases)"),
            "floor_ms": fs,
            "ratio_p50": round(hs["p50"] / fs["p50"], 2),
            "ratio_p99": round(hs["p99"] / fs["p99"], 2),
            "tokens_strictly_increasing": all(x < y for x, y in itertools.pairwise(tokens)),
            "waiter_not_blocked_before_yield": not_blocked,
            "waiter_server_waited_ms": C.summarize(waited_ms),
            "placement": {"A": f"{lead.replica_id} (leader)", "B": f"{followers[0].replica_id} (follower)"},
            "process_cpu": usage,
            "machine": cpu.machine,
            "pass_ratio": hs["p50"] <= TARGET_RATIO * fs["p50"],
            "pass_p99": hs["p99"] <= TARGET_P99_MS,
        }


async def _timed(coro):
    r = await coro
    return r, C.now()


def rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        h, f = r["handoff_ms"], r["floor_ms"]
        out.append([f"{r['etcd_members']}", h["n"], h["p50"], h["p99"], h["max"], f["p50"], f["p99"],
                    r["ratio_p50"], f"<= {TARGET_RATIO}", C.verdict(r["pass_ratio"]),
                    f"<= {TARGET_P99_MS}", C.verdict(r["pass_p99"])])
    return out


HEADERS = ["etcd", "n", "p50 ms", "p99 ms", "max ms", "floor p50", "floor p99", "p50/floor",
           "target", "", "p99 target", ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__.split("\n")[0])
    p.add_argument("--members", type=int, nargs="+", default=[1, 3], help="etcd cluster sizes to run")
    p.add_argument("--handoffs", type=int, default=2000, help="measured handoffs (and floor samples) per size")
    p.add_argument("--block", type=int, default=200, help="handoffs per block; floor blocks alternate with them")
    p.add_argument("--settle-ms", type=float, default=2.0,
                   help="pause after B shows as a waiter in its replica's mirror, before A yields")
    p.add_argument("--phases", action="store_true",
                   help="also split each handoff with an extra etcd watcher (perturbs the figures a little)")
    p.add_argument("--warmup", type=int, default=50, help="unmeasured handoffs and floor samples first")
    args = p.parse_args(argv)
    results = [asyncio.run(run_members(m, args.handoffs, args.block, args.settle_ms, args.warmup,
                                       args.phases))
               for m in args.members]
    print("Handoff latency (A Yield call -> B Acquire returns), nothing to move; "
          "floor = 1 etcd txn + its watch delivery")
    print(C.table(HEADERS, rows(results)))
    for r in results:
        d = r["handoff_ms_by_direction"]
        print(f"  etcd={r['etcd_members']}: p50 to follower {d['to_follower'].get('p50')} ms, "
              f"to leader {d['to_leader'].get('p50')} ms; tokens increasing: {r['tokens_strictly_increasing']}; "
              f"waiter not blocked at yield: {r['waiter_not_blocked_before_yield']}")
        m = r["machine"]
        print(f"    machine: {m['machine_busy_pct_all_cores']}% of {m['cores']} cores busy during the run "
              f"(these processes {m['measured_processes_cpu_pct_of_all_cores']}%), load average "
              f"{m['loadavg_1min_start_end'][0]:.1f} -> {m['loadavg_1min_start_end'][1]:.1f}")
        ph = r["handoff_phases_ms_since_yield_call"]
        if isinstance(ph, dict):
            print(f"    phases (p50 ms after the Yield call): yield reply {ph['yield_rpc_returned'].get('p50')}, "
                  f"release seen by a watcher {ph['release_seen_by_watcher'].get('p50')}, "
                  f"grant seen by a watcher {ph['grant_seen_by_watcher'].get('p50')}, "
                  f"B's Acquire returned {r['handoff_ms']['p50']}")
    print("  " + C.SHARED_CORES_NOTE.format(n=C.os.cpu_count()))
    path = C.write_result("handoff", C.command_line("benchmarks.handoff", argv if argv is not None else sys.argv[1:]),
                          vars(args), {"runs": results},
                          targets={"p50_over_floor_p50": TARGET_RATIO, "p99_ms": TARGET_P99_MS},
                          lockd_flags="defaults")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
