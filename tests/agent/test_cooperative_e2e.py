"""End to end, cooperative: real lockd + agent + two job processes on the public client, whose
memory is SimCooperativeMemory on a SIMULATED device too small for both.

Each handover pauses the resident job through its own channel: the offload region is copied to
its retained host backup and comes back bit-exact, the discard region is dropped (0 bytes moved)
and comes back empty; a stray device call outside a hold fails loudly; a job killed while parked
leaves nothing behind (no status, no device bytes) and the other job goes on.
"""
from __future__ import annotations

import os

import pytest
from agenthelpers import NODE, MiB, status, wait_agent
from jobhelpers import Job, wait_for

from timeslice.common.server import records as R
from timeslice.common.sim.device import SimDevice
from timeslice.testing.lockd import LockdCluster

WEIGHTS, KV = 4 * MiB, 2 * MiB
FOOTPRINT = 1 * MiB + WEIGHTS + KV          # context + regions: two do not fit in 10 MiB
REGIONS = f"weights:{WEIGHTS}:offload,kv:{KV}:discard"


class Stack:
    """lockd (one replica) + the test's agent + group ``g`` over the node; job processes made by ``job``."""

    def __init__(self, etcd, key_prefix, agents, sim_dir, tmp_path):
        from timeslice import OrchestratorClient
        self.sim_dir = sim_dir
        self.lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
        self.agent = agents()
        self.target = self.lockd.replicas[0].target
        self.jobs: list[Job] = []
        with OrchestratorClient(target=self.target, job_id="admin") as admin:
            admin.create_group("g", nodes=[NODE])

    def job(self, name: str, regions: str = REGIONS, env: dict | None = None) -> Job:
        j = Job(self.target, name, self.sim_dir, self.agent.socket, regions, env=env)
        self.jobs.append(j)
        return j

    def stop(self) -> None:
        for j in self.jobs:
            j.kill()
        self.lockd.stop()


@pytest.fixture
def stack_of(etcd, key_prefix, agents, sim_dir, tmp_path):
    made = []

    def make(capacity: int) -> Stack:
        SimDevice(sim_dir, capacity_bytes=capacity)
        made.append(Stack(etcd, key_prefix, agents, sim_dir, tmp_path))
        return made[-1]
    yield make
    for s in made:
        s.stop()


async def test_cooperative_handover_offload_discard_and_parked_exit(keys, client, stack_of, sim_dir):
    stack = stack_of(10 * MiB)
    dev = SimDevice(sim_dir)
    a = stack.job("coop-a")
    ga = a(f"acquire g {FOOTPRINT}")
    assert ga["ok"] and not ga["restored"], ga
    assert a("write weights 0badcafe")["ok"]
    assert a("yield g")["ok"]

    b = stack.job("coop-b")
    gb = b(f"acquire g {FOOTPRINT}")
    assert gb["ok"], gb
    # A was paused through its channel: its offload region was copied, its discard region dropped.
    st = await status(client, keys, NODE, "coop-a")
    assert (st.state, st.outcome, st.bytes) == (R.SNAPSHOTTED, R.OK, WEIGHTS)
    # What the pause left on the device (the simulated CUDA context), as A measured it, is on
    # record: in A's node status and in `timeslice status`.
    assert st.residue_bytes == 1 * MiB
    from timeslice import OrchestratorClient
    from timeslice.render import human_bytes, status_text
    with OrchestratorClient(target=stack.target, job_id="watcher") as watcher:
        gs = watcher.status("g")
    (job,) = [j for n in gs.node_status for j in n.jobs if j.job_id == "coop-a"]
    assert job.residue_bytes == 1 * MiB
    assert "RESIDUE" in status_text(gs) and human_bytes(MiB) in status_text(gs)
    sa = a("swaps")
    assert sa["paused"] == ["weights", "kv"] or sorted(sa["paused"]) == ["kv", "weights"]
    assert sa["host_bytes"] == WEIGHTS           # the retained backup: offload regions only
    # A stray device call outside a hold fails loudly (as a released page faults on a GPU).
    stray = a("touch weights 1")
    assert not stray["ok"] and "released" in stray["error"]

    assert b("yield g")["ok"]
    ga2 = a(f"acquire g {FOOTPRINT}")
    assert ga2["ok"] and ga2["restored"] and ga2["token"] > gb["token"], ga2
    assert a("verify weights")["match"]           # bit-exact, including what A wrote
    assert a("verify kv")["match"]                # recreated empty
    assert a("yield g")["ok"]
    gb2 = b(f"acquire g {FOOTPRINT}")
    assert gb2["ok"] and gb2["restored"], gb2
    assert b("verify weights")["match"]
    assert b("yield g")["ok"]

    # A is parked now. Kill it: nothing of it may stay behind, and B goes on.
    assert (await status(client, keys, NODE, "coop-a")).state == R.SNAPSHOTTED
    a.kill()

    async def gone():
        st = await status(client, keys, NODE, "coop-a")
        return st is None or st.state == R.GONE
    await wait_for(gone, 30, "the parked job's status cleared")
    await wait_for(lambda: _async(a.pid not in dev.ledger.snapshot()[1]), 30, "its device bytes released")
    gb3 = b(f"acquire g {FOOTPRINT}")
    assert gb3["ok"] and b("verify weights")["match"]
    assert b("yield g")["ok"]
    assert b("quit")["ok"]



@pytest.mark.slow
async def test_a_parked_job_killed_and_restarted_under_its_id_swaps_cooperatively_again(keys, client, stack_of):
    """The job is killed while parked and started again at once under the same job id: a new
    session with a new secret. Its new worker must be let in by the agent (not refused with the
    first run's secret digest), take its turn, and be paused and resumed through its own channel."""
    stack = stack_of(10 * MiB)
    a = stack.job("coop-re")
    assert a(f"acquire g {FOOTPRINT}")["ok"] and a("write weights 0badcafe")["ok"] and a("yield g")["ok"]
    b = stack.job("coop-other")
    assert b(f"acquire g {FOOTPRINT}")["ok"] and b("yield g")["ok"]
    assert (await status(client, keys, NODE, "coop-re")).state == R.SNAPSHOTTED
    a.kill()

    again = stack.job("coop-re")                    # same id, a new process, a new session
    g = again(f"acquire g {FOOTPRINT}")
    assert g["ok"] and not g["restored"], g         # the first run's snapshot died with it
    assert again("verify weights")["match"]         # its own fresh memory, not the first run's bytes
    assert again("yield g")["ok"]
    gb = b(f"acquire g {FOOTPRINT}")
    assert gb["ok"] and gb["restored"] and b("verify weights")["match"], gb
    st = await status(client, keys, NODE, "coop-re")
    assert (st.state, st.outcome, st.bytes, st.pids) == (R.SNAPSHOTTED, R.OK, WEIGHTS, [again.pid]), st
    assert b("yield g")["ok"]
    g2 = again(f"acquire g {FOOTPRINT}")
    assert g2["ok"] and g2["restored"] and again("verify weights")["match"], g2
    assert again("yield g")["ok"] and again("quit")["ok"]


async def _async(v):
    return v


async def test_only_what_the_incoming_job_needs_is_released(keys, client, stack_of):
    """A holds 7 MiB (context, 4 MiB weights, 2 MiB discardable kv) of an 8 MiB device; B needs 2 MiB.
    The leader asks A to free only the shortfall: A drops its kv (nothing copied) and keeps its weights."""
    stack = stack_of(8 * MiB)
    a = stack.job("sel-a")
    b = stack.job("sel-b", regions=f"weights:{MiB}:offload")
    assert a(f"acquire g {FOOTPRINT}")["ok"] and a("yield g")["ok"]
    # The leader decides from the agent's report: let it show all of A (its context too).
    await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("sel-a") == FOOTPRINT)
    gb = b(f"acquire g {2 * MiB}")
    assert gb["ok"] and gb["bytes_moved"] == 0, gb          # a discard region moves nothing
    assert a("swaps")["paused"] == ["kv"]
    st = await status(client, keys, NODE, "sel-a")
    assert (st.state, st.bytes, st.device_bytes) == (R.SNAPSHOTTED, 0, KV)
    assert b("verify weights")["match"] and b("yield g")["ok"]
    ga = a(f"acquire g {FOOTPRINT}")
    assert ga["ok"] and ga["restored"], ga
    assert a("verify weights")["match"] and a("verify kv")["match"]
    assert a("yield g")["ok"]


async def test_the_async_client_cooperates_too(etcd, key_prefix, keys, client, agents, sim_dir, tmp_path):
    from timeslice import AsyncOrchestratorClient
    from timeslice.sim.coop import SimCooperativeMemory
    SimDevice(sim_dir, capacity_bytes=10 * MiB)
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
    agent = agents()
    try:
        async with AsyncOrchestratorClient(target=lockd.replicas[0].target, job_id="coop-aio") as c:
            await c.create_group("g", nodes=[NODE])
            await c.acquire("g", timeout=30)
            mem = SimCooperativeMemory({"weights": (MiB, "offload")}, sim_dir, gbps=0)
            w = await c.cooperate(mem, node=NODE, socket_path=agent.socket)
            assert w.pid == os.getpid()
            from agenthelpers import get
            kv = await get(client, keys.worker("coop-aio", NODE, w.pid))
            reg = R.WorkerValue.load(kv.value)
            assert (reg.swap, reg.tags) == (R.SWAP_COOPERATIVE, {"weights": "offload"})
            assert mem.host_bytes() == MiB                     # prepinned at registration
            await c.yield_("g")
        assert w._closed.is_set()                              # close() closed the channel
        mem.close()
    finally:
        lockd.stop()
