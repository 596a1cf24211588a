"""Strict groups: on an elided handoff (the next job fits beside the yielded one) the
yielded job is frozen at the device *before* the next grant, and thawed before its own next
grant; its stray device calls wait meanwhile. A group without the policy is unchanged. A frozen
job that leaves (closes its session, or dies) leaves nothing behind. Real etcd, lockd, agent and
SIMULATED-device worker processes.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
from agenthelpers import NODE, MiB, get, status, wait_agent

from timeslice.common.server import records as R
from timeslice.common.sim.device import SimDevice
from timeslice.proto import lockd_pb2 as lpb

JOB = 3 * MiB          # two fit on the 10 MiB device: every handoff here is elided


class Jobs:
    def __init__(self, stub, client, keys, workers):
        self.stub, self.client, self.keys, self.workers = stub, client, keys, workers
        self.sess, self.w = {}, {}

    async def start(self, job: str, seed: int):
        self.sess[job] = await self.stub.OpenSession(lpb.OpenSessionRequest(job_id=job, ttl_seconds=60))
        self.w[job] = w = self.workers(JOB, seed=seed)
        await self.stub.RegisterWorker(lpb.WorkerRequest(job_id=job, session_secret=self.sess[job].session_secret,
                                                         node=NODE, pid=w.pid, device_bytes=JOB))
        await wait_agent(self.client, self.keys, NODE, lambda a: a.job_device_bytes.get(job) == JOB)
        return w

    async def acquire(self, job: str):
        return await self.stub.Acquire(lpb.AcquireRequest(job_id=job, session_secret=self.sess[job].session_secret,
                                                          group_id="g", device_bytes_hint=JOB), timeout=30)

    async def elided_handoff(self):
        """A and B (they fit side by side) start; A acquires and yields; B is granted.
        Returns A's and B's workers and grants."""
        wa, wb = await self.start("A", 3), await self.start("B", 4)
        ga = await self.acquire("A")
        await self.yield_("A", ga.token)
        return wa, wb, ga, await self.acquire("B")

    async def yield_(self, job: str, token: int):
        await self.stub.Yield(lpb.YieldRequest(job_id=job, session_secret=self.sess[job].session_secret,
                                               group_id="g", token=token))


@asynccontextmanager
async def cluster(lockd_node, client, keys, workers, isolation: str):
    async with lockd_node(10 * MiB, isolation=isolation) as n:
        yield Jobs(n.stub, client, keys, workers), n.lockd, n.agent


async def _answered_before_grant(client, keys, job: str) -> bool:
    """The agent's answer (the job's status) was in etcd before the group's current grant was
    written: etcd's revisions order the two writes (log timestamps of two processes would not:
    the agent logs its op after writing the answer the leader may already have acted on)."""
    skv, gkv = await get(client, keys.status(NODE, job)), await get(client, keys.grant("g"))
    assert skv is not None and gkv is not None
    return skv.mod_revision < gkv.create_revision


@pytest.fixture
def world(lockd_node, keys, client, workers):
    return lambda iso: cluster(lockd_node, client, keys, workers, iso)


async def test_a_yielded_job_is_frozen_before_an_elided_grant_and_thawed_before_its_own(world, client, keys, sim_dir):
    dev = SimDevice(sim_dir)
    async with world(R.ISOLATION_STRICT) as (jobs, lockd, agent):
        [g] = (await jobs.stub.ListGroups(lpb.ListGroupsRequest())).groups
        assert g.isolation == "strict"           # CreateGroup(isolation="strict") took it
        wa, wb, ga, gb = await jobs.elided_handoff()
        assert gb.elided and gb.bytes_moved == 0 and not gb.restored        # nothing moved: a strict handoff
        # By the time B was granted, A was frozen in place, answered through its status.
        st = await status(client, keys, NODE, "A")
        assert (st.state, st.op, st.outcome, st.token) == (R.FROZEN, R.FREEZE, R.OK, gb.token)
        assert dev.read_state(wa.pid)["state"] == "locked" and dev.held(wa.pid) == JOB
        assert await _answered_before_grant(client, keys, "A")
        with pytest.raises(TimeoutError):
            wa.ask("verify", timeout=0.5)        # A's stray device call waits; B runs
        assert wb.verify()
        # A acquires again: B (yielded) is frozen, A thawed, before A's grant; A's waiting call ran.
        await jobs.yield_("B", gb.token)
        ga2 = await jobs.acquire("A")
        assert wa.read() == f"VERIFY OK {wa.expected}"
        st = await status(client, keys, NODE, "A")
        assert (st.state, st.op, st.outcome, st.token) == (R.RUNNING, R.THAW, R.OK, ga2.token)
        assert (await status(client, keys, NODE, "B")).state == R.FROZEN
        assert dev.read_state(wb.pid)["state"] == "locked"
        assert wa.verify()
        assert await _answered_before_grant(client, keys, "A")


async def test_without_the_policy_an_elided_handoff_freezes_nothing(world, client, keys, sim_dir):
    dev = SimDevice(sim_dir)
    async with world(R.ISOLATION_NONE) as (jobs, _lockd, agent):
        wa, _, _, gb = await jobs.elided_handoff()
        assert gb.elided and gb.bytes_moved == 0
        assert dev.read_state(wa.pid)["state"] == "running"
        assert wa.verify()                       # as before: nothing at the device stops it
        assert await get(client, keys.intent(NODE, "A")) is None
        assert agent.events("op_started", job="A") == []


async def test_a_frozen_job_that_closes_its_session_is_thawed_to_exit_and_leaves_nothing(world, client, keys,
                                                                                        sim_dir):
    dev = SimDevice(sim_dir)
    async with world(R.ISOLATION_STRICT) as (jobs, _lockd, agent):
        wa, _, _, _ = await jobs.elided_handoff()
        assert dev.read_state(wa.pid)["state"] == "locked"
        # A leaves on purpose while frozen: its teardown touches the device (as a CUDA process's
        # exit does), so the agent lifts the freeze rather than let the exit wait on it.
        await jobs.stub.CloseSession(lpb.SessionRef(job_id="A", session_secret=jobs.sess["A"].session_secret))
        agent.wait_events("frozen_job_left", 1, job="A", pid=wa.pid)
        assert wa.ask("free", timeout=10) == "FREED"
        assert wa.ask("quit") == "BYE" and wa.proc.wait(10) == 0
        await _nothing_left(client, keys, dev, wa.pid, "A")


@pytest.mark.slow
async def test_a_frozen_job_that_dies_leaves_nothing(world, client, keys, etcd, sim_dir):
    dev = SimDevice(sim_dir)
    async with world(R.ISOLATION_STRICT) as (jobs, _lockd, _agent):
        wa, _, _, gb = await jobs.elided_handoff()
        assert dev.read_state(wa.pid)["state"] == "locked"
        wa.kill()                                # dies frozen; its session expires with it
        etcd.revoke_lease(jobs.sess["A"].lease_id)
        await _nothing_left(client, keys, dev, wa.pid, "A")
        # The group goes on: B yields, C is granted with nothing of A in the way.
        await jobs.yield_("B", gb.token)
        await jobs.start("C", 5)
        assert (await jobs.acquire("C")).token > gb.token


async def _nothing_left(client, keys, dev, pid: int, job: str) -> None:
    """The process is forgotten by the device, the agent's report and (after lockd's housekeeping) etcd."""
    deadline = time.monotonic() + 30
    while dev.read_state(pid) is not None or dev.held(pid):
        assert time.monotonic() < deadline, "the simulated device still knows the exited worker"
        await asyncio.sleep(0.05)
    await wait_agent(client, keys, NODE, lambda a: job not in a.job_device_bytes and job not in a.job_gpus)
    # Its status turns "gone" (no longer frozen), and lockd's housekeeping then forgets it and its intent.
    while await get(client, keys.status(NODE, job)) is not None or await get(client, keys.intent(NODE, job)):
        assert time.monotonic() < deadline, f"lockd kept the departed job's keys: {await status(client, keys, NODE, job)}"
        await asyncio.sleep(0.2)


async def test_a_freeze_outlives_an_agent_restart(world, client, keys, sim_dir):
    dev = SimDevice(sim_dir)
    async with world(R.ISOLATION_STRICT) as (jobs, _lockd, agent):
        wa, _, _, _ = await jobs.elided_handoff()
        agent.kill()
        agent.start()
        agent.wait_events("agent_started", 2)
        # A restarted agent unlocks what a crash left locked mid-op, but not a deliberate freeze.
        assert dev.read_state(wa.pid)["state"] == "locked"
        assert agent.events("reconcile_unlocked", job="A") == []
        with pytest.raises(TimeoutError):
            wa.ask("verify", timeout=0.5)
