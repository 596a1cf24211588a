"""The swap path never loses track of a job: agent restarts with cooperative workers, a partial
pause, a cooperative job that closes while another waits, an agent killed mid-swap.

End to end on one SIMULATED GPU of 32 MiB: real etcd, one lockd replica, the node agent, a
cooperative job in its own process (1 MiB context + 12 MiB offloaded + 7 MiB discarded regions)
and checkpoint jobs whose SimWorkers hold checksummed bytes. What is checked after each fault:
no job is granted with its memory not back (its bytes verify inside the hold), no job is planned
as absent while its memory is on the device (the next job's memory fits when it is granted), and
the next grant comes once the fault heals (bounded waits, well inside lockd's swap timeout).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from agenthelpers import NODE, MiB, get, status, wait_agent, wait_status
from jobhelpers import CkptJob, Job, wait_for

from timeslice.common.server import records as R

COOP = f"weights:{12 * MiB}:offload,kv:{7 * MiB}:discard"
FOOT = 20 * MiB                 # the cooperative job on the device: context + both regions
CAPACITY = 32 * MiB             # two jobs of 20 MiB never fit together


async def intent_of(client, keys, job: str, op: str) -> R.IntentValue | None:
    kv = await get(client, keys.intent(NODE, job))
    iv = R.IntentValue.load(kv.value) if kv else None
    return iv if iv is not None and iv.op == op else None


def coop(n, sim_dir, job: str = "coop-c", **kw) -> Job:
    return Job(n.lockd.replicas[0].target, job, sim_dir, n.agent.socket, COOP, **kw)


async def resident_coop(n, client, keys, sim_dir, **kw) -> Job:
    """The cooperative job, granted, its weights written, yielded with nobody waiting: resident."""
    c = coop(n, sim_dir, **kw)
    assert c(f"acquire g {FOOT}")["ok"] and c("write weights 0badcafe")["ok"]
    assert c("yield g")["deferred"]
    await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("coop-c") == FOOT)
    return c


async def parked_coop(n, client, keys, sim_dir, workers, **kw) -> tuple[Job, CkptJob]:
    """The cooperative job paused for a checkpoint job B, which holds 20 MiB and has yielded (resident)."""
    c = await resident_coop(n, client, keys, sim_dir, **kw)
    b = await CkptJob(n.stub, "ckpt-b").open()
    gb = await b.acquire(FOOT)
    assert gb.bytes_moved == 12 * MiB, gb                   # C's weights copied out, its kv dropped
    await b.register(workers(FOOT, seed=2), FOOT)           # fits only now
    assert (await b.yield_()).deferred_snapshot
    assert (await status(client, keys, NODE, "coop-c")).state == R.SNAPSHOTTED
    return c, b


async def back_and_intact(c: Job) -> None:
    g = await c.ask(f"acquire g {FOOT}")
    assert g["ok"] and g["restored"], g
    assert c("verify weights")["match"] and c("verify kv")["match"]
    assert c("yield g")["ok"]


# --- (a) the agent restarts while a cooperative worker has not reconnected yet ----------------

async def test_a_resident_cooperative_job_not_reconnected_yet_is_paused_before_the_next_grant(
        keys, client, lockd_node, workers, sim_dir):
    """C stayed resident after its yield; the agent restarts and C's worker is not back yet. B
    (20 MiB) must not be granted beside C's 20 MiB: the leader asks for C's pause, and the agent
    carries it out once C reconnects."""
    async with lockd_node(CAPACITY) as n:
        c = await resident_coop(n, client, keys, sim_dir)
        try:
            assert c("channel hold")["ok"]
            n.agent.kill()
            n.agent.start()
            b = await CkptJob(n.stub, "ckpt-b").open()
            got = asyncio.create_task(b.acquire(FOOT))
            await wait_for(lambda: intent_of(client, keys, "coop-c", R.SNAPSHOT), 15,
                           "the leader asks for C's pause (today: B is granted at once, beside C)")
            assert not got.done(), "B was granted while C's 20 MiB are on the device"
            assert c("channel release")["ok"]
            gb = await asyncio.wait_for(got, 20)
            assert gb.bytes_moved == 12 * MiB, gb
            await b.register(workers(FOOT, seed=2), FOOT)   # B's memory fits: C's is really gone
            assert (await status(client, keys, NODE, "coop-c")).state == R.SNAPSHOTTED
            await b.yield_()
            await back_and_intact(c)
        finally:
            c.kill()


async def test_a_paused_cooperative_job_is_resumed_before_its_grant_though_it_reconnects_late(
        keys, client, lockd_node, workers, sim_dir):
    """C was paused before the restart and acquires at once afterwards, before its worker is back.
    Its grant must wait for the resume (never restored=False on released regions)."""
    async with lockd_node(CAPACITY) as n:
        c, b = await parked_coop(n, client, keys, sim_dir, workers)
        try:
            assert c("channel hold 5")["ok"]
            n.agent.kill()
            n.agent.start()
            await back_and_intact(c)
            gb = await b.acquire(FOOT)                      # B went out for C: back, and whole
            assert gb.restored and b.worker.verify(), gb
        finally:
            c.kill()


async def test_a_worker_that_never_reconnects_fails_the_waiter_with_the_reason(
        keys, client, lockd_node, workers, sim_dir):
    """Past --reconnect-grace-s the waiter is told why; it is never granted with regions released,
    and once the worker is back the next Acquire restores it."""
    async with lockd_node(CAPACITY, agent_extra=["--reconnect-grace-s", "2"]) as n:
        c, _ = await parked_coop(n, client, keys, sim_dir, workers)
        try:
            assert c("channel hold")["ok"]
            n.agent.kill()
            n.agent.start()
            for _ in range(2):                              # and again: still not granted unresumed
                r = await c.ask(f"acquire g {FOOT}")
                assert not r["ok"] and "reconnect" in r["error"], r
            assert c("channel release")["ok"]
            await wait_agent(client, keys, NODE, lambda a: "coop-c" not in a.job_unknown)
            await back_and_intact(c)
        finally:
            c.kill()


async def test_a_resident_worker_that_never_reconnects_fails_the_other_jobs_acquire_with_the_reason(
        keys, client, lockd_node, workers, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=["--reconnect-grace-s", "2"]) as n:
        c = await resident_coop(n, client, keys, sim_dir)
        try:
            assert c("channel hold")["ok"]
            n.agent.kill()
            n.agent.start()
            b = await CkptJob(n.stub, "ckpt-b").open()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await b.acquire(FOOT, timeout=30)
            assert "reconnect" in e.value.details(), e.value.details()
            assert c("channel release")["ok"]
            await wait_agent(client, keys, NODE, lambda a: "coop-c" not in a.job_unknown)
            gb = await b.acquire(FOOT)
            assert gb.bytes_moved == 12 * MiB, gb
            await b.register(workers(FOOT, seed=2), FOOT)
            await b.yield_()
            await back_and_intact(c)
        finally:
            c.kill()


# --- (b) a partial (selective) pause, then a job that needs the whole GPU -------------------

async def test_a_partially_paused_job_is_asked_for_the_rest_when_the_next_job_needs_it(
        keys, client, lockd_node, workers, sim_dir):
    """A (checkpoint, 20 MiB) yields; C (cooperative) comes in; E (18 MiB) needs only C's 7 MiB kv,
    so C keeps its weights on the device; then A needs 20 MiB back. C's weights must be asked to
    go too. Today A's restore is refused for room every ~2 s until lockd's swap timeout."""
    async with lockd_node(CAPACITY, lockd_extra=["--swap-timeout", "10"]) as n:
        a = await CkptJob(n.stub, "ckpt-a").open()
        await a.acquire(FOOT)
        await a.register(workers(FOOT, seed=1), FOOT)
        await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("ckpt-a") == FOOT)
        await a.yield_()
        c = coop(n, sim_dir)
        try:
            assert c(f"acquire g {FOOT}")["ok"] and c("write weights 0badcafe")["ok"]
            await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("coop-c") == FOOT)
            assert c("yield g")["deferred"]
            e = await CkptJob(n.stub, "ckpt-e").open()
            # 14 MiB declared: on a first hold lockd admits 18 MiB with its spare (lockd/footprints.py).
            ge = await e.acquire(14 * MiB)
            assert ge.bytes_moved == 0, ge                  # C dropped its kv only: nothing copied
            assert c("swaps")["paused"] == ["kv"]
            await e.register(workers(18 * MiB, seed=3), 18 * MiB)
            await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("ckpt-e") == 18 * MiB)
            await e.yield_()
            ga = await a.acquire(FOOT, timeout=30)
            assert ga.restored and a.worker.verify(), ga
            assert sorted(c("swaps")["paused"]) == ["kv", "weights"]
            await a.yield_()
            await back_and_intact(c)
        finally:
            c.kill()


# --- (c) a cooperative job closes its session while another job waits for its GPU ------------

async def test_a_cooperative_holder_that_closes_is_waited_for_until_its_memory_is_gone(
        keys, client, lockd_node, workers, sim_dir):
    """C holds; B waits; C closes its client (channel and session) and its process lingers a
    moment before it exits, as a job's does. B must not be granted while C's memory is still on
    the device, and is granted once it is gone."""
    async with lockd_node(CAPACITY) as n:
        c = coop(n, sim_dir)
        try:
            assert c(f"acquire g {FOOT}")["ok"]
            await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("coop-c") == FOOT)
            b = await CkptJob(n.stub, "ckpt-b").open()
            got = asyncio.create_task(b.acquire(FOOT))
            await wait_for(lambda: _queued(client, keys, "ckpt-b"), 10, "B queued")
            assert c("close")["ok"]
            # The close ends C's session and registrations at once; its memory stays until it exits.
            await wait_for(lambda: _not_queued(client, keys, "coop-c"), 10, "C's queue entry gone")
            for _ in range(30):
                assert not got.done(), "B was granted while C's 20 MiB were still on the device"
                await asyncio.sleep(0.1)
            c.kill()
            gb = await asyncio.wait_for(got, 20)
            assert not gb.restored, gb
            await b.register(workers(FOOT, seed=2), FOOT)   # fits: C's memory went with its process
        finally:
            c.kill()


async def test_a_cooperative_job_closing_while_it_is_paused_is_not_checkpointed_and_the_waiter_gets_in(
        keys, client, lockd_node, workers, sim_dir, tmp_path):
    """C yields to a waiting B and closes at once, while the agent is still pausing it (its copy is
    slow here): the channel goes mid-pause and then the registration. The agent must neither take C
    for a checkpoint-backend process nor fail B: C's memory goes with its process, B is granted,
    and no partial host copy is left on the simulated host."""
    async with lockd_node(CAPACITY) as n:
        c = coop(n, sim_dir, env={"TIMESLICE_SIM_COOP_GBPS": "0.01"})    # 12 MiB: ~1.3 s
        try:
            assert c(f"acquire g {FOOT}")["ok"]
            await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("coop-c") == FOOT)
            b = await CkptJob(n.stub, "ckpt-b").open()
            got = asyncio.create_task(b.acquire(FOOT))
            await wait_for(lambda: _queued(client, keys, "ckpt-b"), 10, "B queued")
            assert c("yield g")["ok"]
            await wait_status(client, keys, NODE, "coop-c", lambda s: s.state == R.SNAPSHOTTING)
            assert c("close")["ok"]
            c.kill()
            await asyncio.wait_for(got, 30)
            await b.register(workers(FOOT, seed=2), FOOT)
            assert b.worker.verify()
            assert not list((tmp_path / "host").glob("*.partial"))
            assert not n.agent.events("sim_locked", pid=c.pid)     # never taken for a checkpoint process
        finally:
            c.kill()


async def _queued(client, keys, job: str) -> bool:
    return await get(client, keys.queue_entry("g", job)) is not None


async def _not_queued(client, keys, job: str) -> bool:
    return await get(client, keys.queue_entry("g", job)) is None


# --- the agent killed mid-swap ---------------------------------------------------------------

async def test_the_agent_killed_mid_pause_of_a_cooperative_worker(keys, client, lockd_node, workers, sim_dir):
    async with lockd_node(CAPACITY) as n:
        c = await resident_coop(n, client, keys, sim_dir, env={"TIMESLICE_SIM_COOP_GBPS": "0.01"})
        try:
            b = await CkptJob(n.stub, "ckpt-b").open()
            assert c("channel hold 4")["ok"]                # once the channel drops, back in 4 s at the earliest
            got = asyncio.create_task(b.acquire(FOOT))
            await wait_status(client, keys, NODE, "coop-c", lambda s: s.state == R.SNAPSHOTTING)
            n.agent.kill()
            n.agent.start()
            gb = await asyncio.wait_for(got, 30)
            await b.register(workers(FOOT, seed=2), FOOT)   # C's memory really went
            st = await status(client, keys, NODE, "coop-c")
            assert (st.state, st.outcome, st.token) == (R.SNAPSHOTTED, R.OK, gb.token), st
            await b.yield_()
            await back_and_intact(c)
        finally:
            c.kill()


async def test_the_agent_killed_mid_resume_of_a_cooperative_worker(keys, client, lockd_node, workers, sim_dir):
    async with lockd_node(CAPACITY) as n:
        c, b = await parked_coop(n, client, keys, sim_dir, workers, env={"TIMESLICE_SIM_COOP_GBPS": "0.01"})
        try:
            assert c("channel hold 5")["ok"]
            got = asyncio.create_task(c.ask(f"acquire g {FOOT}"))
            await wait_status(client, keys, NODE, "coop-c", lambda s: s.state == R.RESTORING, timeout=20)
            n.agent.kill()
            n.agent.start()
            g = await asyncio.wait_for(got, 40)
            assert g["ok"] and g["restored"], g
            assert c("verify weights")["match"] and c("verify kv")["match"]
            assert c("yield g")["ok"]
            gb = await b.acquire(FOOT)
            assert gb.restored and b.worker.verify(), gb
        finally:
            c.kill()


async def test_the_agent_killed_mid_snapshot_and_mid_restore_of_checkpoint_jobs(
        keys, client, lockd_node, workers):
    """The simulated checkpoint backend at 10 MB/s: 20 MiB take ~2 s each way to kill the agent in."""
    slow = ["--sim-checkpoint-gbps", "0.01", "--sim-restore-gbps", "0.01"]
    async with lockd_node(CAPACITY, agent_extra=slow) as n:
        a = await CkptJob(n.stub, "ckpt-a").open()
        await a.acquire(FOOT)
        await a.register(workers(FOOT, seed=1), FOOT)
        await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("ckpt-a") == FOOT)
        await a.yield_()
        b = await CkptJob(n.stub, "ckpt-b").open()
        got = asyncio.create_task(b.acquire(FOOT))
        await wait_status(client, keys, NODE, "ckpt-a", lambda s: s.state == R.SNAPSHOTTING)
        await asyncio.sleep(0.3)                            # inside the copy
        n.agent.kill()
        n.agent.start()
        await asyncio.wait_for(got, 30)
        await b.register(workers(FOOT, seed=2), FOOT)       # A's memory really went
        await wait_agent(client, keys, NODE, lambda v: v.job_device_bytes.get("ckpt-b") == FOOT)
        await b.yield_()

        got = asyncio.create_task(a.acquire(FOOT))
        await wait_status(client, keys, NODE, "ckpt-a", lambda s: s.state == R.RESTORING, timeout=20)
        await asyncio.sleep(0.3)
        n.agent.kill()
        n.agent.start()
        ga = await asyncio.wait_for(got, 40)
        assert ga.restored and a.worker.verify(), ga
        await a.yield_()
        gb = await b.acquire(FOOT)
        assert gb.restored and b.worker.verify(), gb
