"""Jobs over several GPUs and nodes, end to end without a GPU.

Real etcd, real lockd, two real node agents on one machine, each with its own
SIMULATED device of 4 GPUs (separate sim dirs), and jobs of 4 worker processes
(2 per node) holding real, checksummed bytes, one GPU full and the others
nearly empty. Swaps run on both nodes at once and per process; an agent
killed mid-swap fails that swap with the reason, and nothing is lost.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from agenthelpers import MiB, status, wait_agent, wait_status

from chaos_tests.holders import check_holders_not_parked, etcd_history
from timeslice.common.server import records as R
from timeslice.common.sim.device import SimDevice
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.agent import AgentProcess, SimWorker
from timeslice.testing.lockd import LockdCluster, admin_channel

NODES = ("node-1", "node-2")
CAP = 8 * MiB                      # per simulated GPU
# (node, gpu, bytes) of each job's 4 processes: GPU 0 is where they collide.
LAYOUT = {"job-a": [(n, g, b) for n in NODES for g, b in ((0, 8 * MiB), (1, 1 * MiB))],
          "job-b": [(n, g, b) for n in NODES for g, b in ((0, 6 * MiB), (2, 1 * MiB))]}


class Cluster:
    def __init__(self, etcd, prefix, tmp_path):
        self.etcd, self.prefix, self.tmp = etcd, prefix, tmp_path
        self.sim = {n: tmp_path / f"sim-{n}" for n in NODES}
        self.host = {n: tmp_path / f"host-{n}" for n in NODES}
        for n in NODES:
            SimDevice(self.sim[n], self.host[n], capacity_bytes=CAP, gpus=4)
        self.agents: dict[str, AgentProcess] = {}
        self.workers: dict[str, list[SimWorker]] = {}
        self.extra_procs: list[subprocess.Popen] = []

    def agent(self, node: str) -> AgentProcess:
        # ~10 MB/s: an 8 MiB checkpoint takes most of a second, long enough to overlap and to kill.
        a = AgentProcess(self.etcd.endpoints_str, self.prefix, node, str(self.tmp), sim_dir=self.sim[node],
                         env={"TIMESLICE_SIM_HOST_DIR": str(self.host[node])},
                         extra=["--sim-checkpoint-gbps", "0.01", "--sim-restore-gbps", "0.01",
                                "--refresh-interval", "0.5", "--agent-lease-ttl", "3"])
        self.agents[node] = a
        return a.start()

    def spawn(self, job: str) -> list[SimWorker]:
        ws = []
        for i, (node, gpu, nbytes) in enumerate(LAYOUT[job]):
            ws.append(SimWorker(self.sim[node], nbytes, seed=sorted(LAYOUT).index(job) * 100 + i, step_ms=20,
                                env={"TIMESLICE_SIM_HOST_DIR": str(self.host[node]),
                                     "TIMESLICE_SIM_GPU": str(gpu)}))
        self.workers[job] = [w.ready() for w in ws]
        return self.workers[job]

    def close(self) -> None:
        for ws in self.workers.values():
            for w in ws:
                w.stop()
        for p in self.extra_procs:
            p.kill()
            p.wait()
        for a in self.agents.values():
            if a.alive():
                a.stop()


@pytest.fixture
def cluster(etcd, key_prefix, tmp_path):
    c = Cluster(etcd, key_prefix, tmp_path)
    yield c
    c.close()


def op_window(st: R.StatusValue) -> tuple[float, float]:
    return st.updated_ms - st.elapsed_ms, st.updated_ms


class Jobs:
    def __init__(self, stub):
        self.stub, self.secret = stub, {}

    async def open(self, *jobs):
        for job in jobs:
            self.secret[job] = (await self.stub.OpenSession(lpb.OpenSessionRequest(job_id=job, ttl_seconds=60))
                                ).session_secret

    async def register(self, job, pid, node, nbytes=0, gpus=()):
        await self.stub.RegisterWorker(lpb.WorkerRequest(job_id=job, session_secret=self.secret[job], node=node,
                                                         pid=pid, device_bytes=nbytes, gpus=list(gpus)))

    async def acquire(self, job, group="g", hint=0, timeout=60):
        return await self.stub.Acquire(lpb.AcquireRequest(job_id=job, session_secret=self.secret[job],
                                                          group_id=group, device_bytes_hint=hint), timeout=timeout)

    async def yield_(self, job, grant, group="g"):
        return await self.stub.Yield(lpb.YieldRequest(job_id=job, session_secret=self.secret[job],
                                                      group_id=group, token=grant.token))


@pytest.mark.slow
async def test_two_nodes_four_gpus_parallel_swaps_and_an_agent_killed_mid_swap(etcd, key_prefix, keys, client,
                                                                               cluster, tmp_path):
    for n in NODES:
        cluster.agent(n)
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path),
                         extra=["--swap-timeout", "8"]).start()
    try:
        async with admin_channel(lockd.replicas[0].target) as ch:
            stub = lpbg.LockdStub(ch)
            await stub.CreateGroup(lpb.CreateGroupRequest(group_id="g", nodes=[
                lpb.NodeSpec(node=n, gpus=[0, 1, 2, 3]) for n in NODES]))
            jobs = Jobs(stub)
            await jobs.open("job-a", "job-b")
            tokens = []

            # A: GPU 0 full and GPU 1 nearly empty on each node, GPUs not declared: the agents say.
            wa = cluster.spawn("job-a")
            for w, (node, _, nbytes) in zip(wa, LAYOUT["job-a"]):
                await jobs.register("job-a", w.pid, node, nbytes)
            for n in NODES:
                await wait_agent(client, keys, n, lambda a: a.job_gpus.get("job-a") == {"sim0": 8 * MiB,
                                                                                        "sim1": 1 * MiB})
            ga = await jobs.acquire("job-a")
            tokens.append(ga.token)
            assert (await jobs.yield_("job-a", ga)).deferred_snapshot

            # B needs 7 MiB per node: 14 MiB are free on each node in sum, none on GPU 0, where
            # A's full GPU is. Planned per GPU: A is snapshotted on both nodes, in parallel.
            gb = await jobs.acquire("job-b", hint=7 * MiB)
            tokens.append(gb.token)
            assert gb.bytes_moved == 2 * 9 * MiB and not gb.elided
            snaps = [await status(client, keys, n, "job-a") for n in NODES]
            assert all((s.state, s.outcome, s.token) == (R.SNAPSHOTTED, R.OK, gb.token) for s in snaps)
            assert all(s.gpu_bytes == {"sim0": 8 * MiB, "sim1": 1 * MiB} for s in snaps)
            (s1, e1), (s2, e2) = (op_window(s) for s in snaps)
            assert s1 < e2 and s2 < e1, "the two nodes' snapshots ran at the same time"
            # B's processes fit only now; they declare their GPUs.
            wb = cluster.spawn("job-b")
            for w, (node, gpu, nbytes) in zip(wb, LAYOUT["job-b"]):
                await jobs.register("job-b", w.pid, node, nbytes, gpus=[gpu])
            for n in NODES:
                await wait_agent(client, keys, n, lambda a: "job-b" in a.job_gpus)
            await jobs.yield_("job-b", gb)

            # A again: B leaves both nodes' GPU 0 and 2, A comes back onto GPUs 0 and 1, bytes intact.
            ga2 = await jobs.acquire("job-a")
            tokens.append(ga2.token)
            assert ga2.restored and ga2.bytes_moved == 2 * (7 + 9) * MiB
            assert all(w.verify() for w in wa)
            await jobs.yield_("job-a", ga2)

            # B again, and node-2's agent is killed while it checkpoints A: B's swap fails with
            # the reason; node-1's copy of A is complete and restorable.
            pending = stub.Acquire(lpb.AcquireRequest(job_id="job-b", session_secret=jobs.secret["job-b"],
                                                      group_id="g", device_bytes_hint=7 * MiB), timeout=60)
            await wait_status(client, keys, "node-2", "job-a", lambda s: s.state == R.SNAPSHOTTING, timeout=30)
            cluster.agents["node-2"].kill()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await pending
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "node-2" in failed.value.details() and "job-a" in failed.value.details()
            st1 = await wait_status(client, keys, "node-1", "job-a", lambda s: s.outcome != "")
            assert (st1.state, st1.outcome) == (R.SNAPSHOTTED, R.OK)

            # The agent comes back (same node, same state dir): it finishes or undoes what it
            # was doing from the processes' own state; then A is restored on both nodes.
            cluster.agent("node-2")
            ga3 = await jobs.acquire("job-a")
            tokens.append(ga3.token)
            assert all(w.verify() for w in wa), "no byte of A lost on either node"
            await jobs.yield_("job-a", ga3)
            gb3 = await jobs.acquire("job-b", hint=7 * MiB)
            tokens.append(gb3.token)
            assert gb3.restored and all(w.verify() for w in wb), "no byte of B lost on either node"
            await jobs.yield_("job-b", gb3)

            assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), "fencing tokens increase"
            grants = lockd.replicas[0].wait_events("grant", len(tokens))
            assert [e["token"] for e in grants] == tokens, "one grant per acquire, in order"
            assert check_holders_not_parked(await etcd_history(client, keys), keys) == []
            for job in jobs.secret:
                await stub.CloseSession(lpb.SessionRef(job_id=job, session_secret=jobs.secret[job]))
    finally:
        lockd.stop()


async def test_a_worker_without_device_context_never_blocks_a_swap(etcd, key_prefix, keys, client, cluster,
                                                                  tmp_path):
    """A job that registered a CPU-only pid (or registered before CUDA init) is
    not resident; another job's Acquire without a size hint is granted, nothing is snapshotted."""
    cluster.agent("node-1")
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path),
                         extra=["--swap-timeout", "8"]).start()
    cpu_only = subprocess.Popen(["sleep", "600"], start_new_session=True)
    cluster.extra_procs.append(cpu_only)
    try:
        async with admin_channel(lockd.replicas[0].target) as ch:
            stub = lpbg.LockdStub(ch)
            await stub.CreateGroup(lpb.CreateGroupRequest(group_id="g", nodes=[lpb.NodeSpec(node="node-1")]))
            jobs = Jobs(stub)
            await jobs.open("job-c", "job-d")
            await jobs.register("job-c", cpu_only.pid, "node-1", gpus=[0])
            await wait_agent(client, keys, "node-1", lambda a: a.job_gpus.get("job-c") == {})
            g = await jobs.acquire("job-d", timeout=20)
            assert (g.restored, g.bytes_moved) == (False, 0)
            assert cluster.agents["node-1"].events("op_started") == []
            assert await status(client, keys, "node-1", "job-c") is None
            await jobs.yield_("job-d", g)

            # A worker registered before it initialised its device, which it does later: from
            # then on it is resident like any other, and the next head makes room.
            late = subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.stdin.readline(); from timeslice.sim.worker import main; "
                 f"main(['--sim-dir', {str(cluster.sim['node-1'])!r}, '--bytes', '{2 * MiB}', '--gpu', '0'])"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
                env={**os.environ, "TIMESLICE_SIM_HOST_DIR": str(cluster.host["node-1"])})
            cluster.extra_procs.append(late)
            await jobs.open("job-e")
            await jobs.register("job-e", late.pid, "node-1")
            await wait_agent(client, keys, "node-1", lambda a: a.job_gpus.get("job-e") == {})
            late.stdin.write("go\n")
            late.stdin.flush()
            assert late.stdout.readline().startswith("READY")
            await wait_agent(client, keys, "node-1", lambda a: a.job_gpus.get("job-e") == {"sim0": 2 * MiB})
            g = await jobs.acquire("job-d", timeout=20)
            assert g.bytes_moved == 2 * MiB, "the initialised worker was made room for"
            st = await status(client, keys, "node-1", "job-e")
            assert (st.state, st.gpu_bytes) == (R.SNAPSHOTTED, {"sim0": 2 * MiB})
            await jobs.yield_("job-d", g)
    finally:
        os.kill(cpu_only.pid, signal.SIGKILL)
        lockd.stop()


async def test_a_holder_is_never_parked_by_another_groups_grant_on_the_same_node(etcd, key_prefix, keys, client,
                                                                                 cluster, tmp_path):
    """PX holds gA (GPU 0) and computes; PY acquires gB (GPU 1 of the same node)
    without a size hint. PX is not snapshotted: its device calls never block while it holds."""
    cluster.agent("node-1")
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path),
                         extra=["--swap-timeout", "8"]).start()
    try:
        async with admin_channel(lockd.replicas[0].target) as ch:
            stub = lpbg.LockdStub(ch)
            for g, gpu in (("gA", 0), ("gB", 1)):
                await stub.CreateGroup(lpb.CreateGroupRequest(group_id=g, nodes=[lpb.NodeSpec(node="node-1",
                                                                                             gpus=[gpu])]))
            jobs = Jobs(stub)
            await jobs.open("PX", "PY")
            px = SimWorker(cluster.sim["node-1"], 4 * MiB, seed=5, step_ms=20,
                           env={"TIMESLICE_SIM_HOST_DIR": str(cluster.host["node-1"]), "TIMESLICE_SIM_GPU": "0"})
            cluster.workers["PX"] = [px.ready()]
            await jobs.register("PX", px.pid, "node-1", 4 * MiB)
            await wait_agent(client, keys, "node-1", lambda a: a.job_gpus.get("PX") == {"sim0": 4 * MiB})
            ga = await jobs.acquire("PX", group="gA")
            gb = await jobs.acquire("PY", group="gB", timeout=20)
            assert (gb.restored, gb.bytes_moved) == (False, 0)
            assert px.verify(timeout=5), "PX computes while it holds gA"
            assert await status(client, keys, "node-1", "PX") is None
            await jobs.yield_("PY", gb, group="gB")
            await jobs.yield_("PX", ga, group="gA")
            assert check_holders_not_parked(await etcd_history(client, keys), keys) == []
    finally:
        lockd.stop()
