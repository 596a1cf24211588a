"""Handoff cost of strict groups: elided handoffs with the yielded job frozen at the device, against
the same elided handoffs in a default group, in one run (SIMULATED device).

One node agent on a SIMULATED device with two GPUs; two groups on that node:
``bench-default`` on GPU 0 (isolation "") and ``bench-strict`` on GPU 1
(isolation "strict"). Each group has two jobs with one worker process each,
bound to the group's GPU, registered, and small enough that both fit: every
handoff is elided (nothing is copied). The workers keep "computing" (a device
operation every ``--worker-step-ms``), as a stray thread of a yielded job
would. Two jobs ping-pong per group, in blocks that alternate between the
groups, so load on the machine hits both alike. A handoff is timed as in
``benchmarks.handoff``: from the holder's Yield call to the waiter's Acquire
returning, the waiter blocked beforehand.

In the default group a handoff is the release and the grant. In the strict
group the leader first writes a freeze intent for the yielded job and, the
waiter having been frozen by the previous handoff, a thaw intent for it; the
agent takes the simulated process lock (waits for the operation in flight)
and releases the other's, answering each through its revisioned status; only
then is the grant written. After each strict handoff the benchmark checks that
the yielded job's status says frozen for this very grant (``frozen_checked``).
The agent's own time per freeze and thaw (status ``elapsed_ms``) is reported
beside. On an H200 the driver's lock/unlock took 2.0 / 1.75 ms per process (benchmarks/results/gpu_round2_session2.md).

    python -m benchmarks.handoff_strict                     # 400 handoffs per group
    python -m benchmarks.handoff_strict --handoffs 100 --block 25
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

from benchmarks import common as C
from benchmarks import procstats as P
from benchmarks.handoff import one_handoff
from timeslice.auth import metadata_for
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig
from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing.agent import AgentProcess, SimWorker

NODE = "bench-node"
MiB = 1 << 20
CONFIGS = (("default", R.ISOLATION_NONE, 0), ("strict", R.ISOLATION_STRICT, 1))   # name, isolation, GPU


async def _status(etcd: EtcdClient, keys: Keys, job: str) -> R.StatusValue | None:
    r = await etcd.range(ops.range_req(keys.status(NODE, job)))
    return R.StatusValue.load(r.kvs[0].value) if r.kvs else None


async def _wait_agent_sees(etcd: EtcdClient, keys: Keys, jobs: list[str], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = await etcd.range(ops.range_req(keys.agent(NODE)))
        if r.kvs and all(R.AgentValue.load(r.kvs[0].value).job_device_bytes.get(j) for j in jobs):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the agent never reported {jobs} on the device")


async def run(handoffs: int, block: int, settle_ms: float, warmup: int, job_mib: int, step_ms: float,
              log_dir: str | None = None) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="bench-strict-")
    sim, host = f"{tmp.name}/sim", f"{tmp.name}/host"
    logs = log_dir or tmp.name
    SimDevice(sim, host, capacity_bytes=8 * job_mib * MiB, gpus=2)
    env = {"TIMESLICE_SIM_HOST_DIR": host}
    workers: list[SimWorker] = []
    with C.Stack(etcd_size=1, replicas=1) as st:
        agent = AgentProcess(st.etcd.endpoints_str, st.prefix, NODE, logs, sim_dir=sim, env=env,
                             extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0"]).start()
        etcd, keys = EtcdClient(EtcdConfig.parse(st.etcd.endpoints_str)), Keys(st.prefix)
        target = st.lockd.replicas[0].target
        chans = C.Channels()
        stub = chans.stub(target)
        pairs: dict[str, tuple[C.Job, C.Job]] = {}
        keep = []
        try:
            for name, iso, gpu in CONFIGS:
                await stub.CreateGroup(pb.CreateGroupRequest(
                    group_id=f"bench-{name}", isolation=iso, nodes=[pb.NodeSpec(node=NODE, gpus=[gpu])]),
                    timeout=10, metadata=metadata_for("CreateGroup"))
                pair = []
                for side in ("a", "b"):
                    job = C.Job(f"{name}-{side}", [target], chans)
                    await job.open()
                    w = SimWorker(sim, job_mib * MiB, seed=len(workers) + 1, step_ms=step_ms,
                                  env={**env, "TIMESLICE_SIM_GPU": str(gpu)})
                    workers.append(w.ready())
                    await stub.RegisterWorker(pb.WorkerRequest(
                        job_id=job.job_id, session_secret=job.secret, node=NODE, pid=w.pid,
                        device_bytes=job_mib * MiB, gpus=[gpu]), timeout=10)
                    keep.append(asyncio.create_task(job.keepalive_loop(3.0)))
                    pair.append(job)
                pairs[name] = (pair[0], pair[1])
            await _wait_agent_sees(etcd, keys, [j.job_id for p in pairs.values() for j in p])
            state = {n: {"holder": a, "waiter": b, "token": (await a.acquire(f"bench-{n}")).token}
                     for n, (a, b) in pairs.items()}
            out = {n: {"ms": [], "elided": 0, "moved": 0, "frozen_checked": 0, "freeze_ms": [], "thaw_ms": []}
                   for n in state}
            cpu = P.CpuMeter({**st.pids(), "agent": agent.pid, "client": C.os.getpid()}).start()
            done = 0
            while done < handoffs + warmup:
                n_block = min(block, handoffs + warmup - done)
                for name, s in state.items():
                    for i in range(n_block):
                        measured = done + i >= warmup
                        ms, reply, _t0, _ty = await one_handoff(s["holder"], s["waiter"], f"bench-{name}",
                                                                s["token"], settle_ms / 1000)
                        s["holder"], s["waiter"], s["token"] = s["waiter"], s["holder"], reply.token
                        if not measured:
                            continue
                        o = out[name]
                        o["ms"].append(ms)
                        o["elided"] += int(reply.elided)
                        o["moved"] += reply.bytes_moved
                        if name == "strict":
                            y = await _status(etcd, keys, s["waiter"].job_id)      # the job that yielded
                            if y is not None and (y.state, y.op, y.token) == (R.FROZEN, R.FREEZE, reply.token):
                                o["frozen_checked"] += 1
                                o["freeze_ms"].append(y.elapsed_ms)
                            h = await _status(etcd, keys, s["holder"].job_id)
                            if h is not None and h.op == R.THAW and h.token == reply.token:
                                o["thaw_ms"].append(h.elapsed_ms)
                done += n_block
            usage = cpu.stop()
        finally:
            for t in keep:
                t.cancel()
            for w in workers:
                w.stop()
            agent.stop()
            await etcd.close()
            await chans.close()
            tmp.cleanup()
    base = C.summarize(out["default"]["ms"])
    figures = {}
    for name, o in out.items():
        s = C.summarize(o["ms"])
        figures[name] = {"handoff_ms": s, "elided": o["elided"], "bytes_moved": o["moved"],
                         "ratio_p50_vs_default": round(s["p50"] / base["p50"], 2),
                         "ratio_p99_vs_default": round(s["p99"] / base["p99"], 2)}
        if name == "strict":
            figures[name].update(frozen_checked=o["frozen_checked"],
                                 agent_freeze_ms=C.summarize(o["freeze_ms"]),
                                 agent_thaw_ms=C.summarize(o["thaw_ms"]))
    return {"figures": figures, "process_cpu": usage, "machine_load": cpu.machine}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handoff_strict", description=__doc__.split("\n")[0])
    p.add_argument("--handoffs", type=int, default=400, help="measured handoffs per group")
    p.add_argument("--block", type=int, default=50, help="handoffs per block; the groups alternate blocks")
    p.add_argument("--settle-ms", type=float, default=2.0, help="pause after the waiter is blocked, before the Yield")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured handoffs per group first")
    p.add_argument("--job-mib", type=int, default=4, help="each worker's simulated device memory, MiB")
    p.add_argument("--worker-step-ms", type=float, default=5.0, help="pause between a worker's device operations")
    p.add_argument("--log-dir", default=None, help="keep the agent's log there (default: a temporary dir)")
    a = p.parse_args(argv)
    res = asyncio.run(run(a.handoffs, a.block, a.settle_ms, a.warmup, a.job_mib, a.worker_step_ms, a.log_dir))
    f = res["figures"]
    print("Elided handoff (Yield call -> Acquire returns), SIMULATED device: strict (yielded job frozen "
          "before the grant) vs default, same run")
    rows = [[n, x["handoff_ms"]["n"], x["handoff_ms"]["p50"], x["handoff_ms"]["p90"], x["handoff_ms"]["p99"],
             x["handoff_ms"]["max"], x["ratio_p50_vs_default"], x["ratio_p99_vs_default"], x["elided"],
             x.get("frozen_checked", "-"), x.get("agent_freeze_ms", {}).get("p50", "-"),
             x.get("agent_thaw_ms", {}).get("p50", "-")] for n, x in f.items()]
    print(C.table(["group", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "p50/default", "p99/default",
                   "elided", "frozen", "agent freeze p50", "agent thaw p50"], rows))
    m = res["machine_load"]
    print(f"  machine: {m['machine_busy_pct_all_cores']}% of {m['cores']} cores busy during the run")
    print("  " + C.SHARED_CORES_NOTE.format(n=C.os.cpu_count()))
    path = C.write_result("handoff_strict", C.command_line("benchmarks.handoff_strict",
                                                           argv if argv is not None else sys.argv[1:]),
                          vars(a), f, process_cpu=res["process_cpu"], machine_load=m,
                          baseline="the default group's elided handoffs in the same run",
                          simulated="SIMULATED device (timeslice.common.sim): the process lock is a state file + flock")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
