"""Restarts: an agent killed mid-op reconciles from etcd and the processes; one agent per node."""
from __future__ import annotations

import asyncio
import threading
import time

from agenthelpers import NODE, MiB, answered, get, intent, register, status, wait_status

from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.sim import SimBackend


async def test_agent_killed_mid_snapshot_reconciles_on_restart(client, keys, agents, workers, sim_dir):
    # 8 MiB at 4 MB/s: two seconds of copying to kill the agent in.
    agent = agents(extra=["--sim-checkpoint-gbps", "0.004"])
    w = workers(8 * MiB, seed=11)
    await register(client, keys, "job-k", NODE, w.pid)
    rev = await intent(client, keys, NODE, "job-k", R.SNAPSHOT, token=40)
    await wait_status(client, keys, NODE, "job-k", lambda s: s.state == R.SNAPSHOTTING)
    await asyncio.sleep(0.5)
    agent.kill()
    st = await status(client, keys, NODE, "job-k")
    assert st.outcome == "" and st.intent_revision == rev      # the leader is still waiting
    assert SimBackend(sim_dir).get_state(w.pid) is ProcState.LOCKED

    t0 = time.monotonic()
    agent.start()                                              # same node, same state dir
    st = await answered(client, keys, NODE, "job-k", rev, timeout=15)
    assert (st.outcome, st.state, st.device_bytes) == (R.OK, R.SNAPSHOTTED, 8 * MiB), st
    assert time.monotonic() - t0 < 10
    rev = await intent(client, keys, NODE, "job-k", R.RESTORE, token=40)
    assert (await answered(client, keys, NODE, "job-k", rev)).state == R.RUNNING
    assert w.verify()


async def test_a_process_left_locked_without_an_intent_is_unlocked_on_start(client, keys, agents, workers,
                                                                             sim_dir):
    w = workers(2 * MiB)
    await register(client, keys, "job-u", NODE, w.pid)
    SimBackend(sim_dir).lock(w.pid, 1000)                      # as a crashed direct call would leave it
    agent = agents()
    agent.wait_event("reconcile_unlocked", job="job-u", pid=w.pid)
    assert w.verify()


async def test_one_agent_per_node_a_paused_agent_keeps_the_node_until_it_dies(client, keys, agents, workers):
    first = agents()
    w = workers(2 * MiB)
    await register(client, keys, "job-p", NODE, w.pid)
    first.pause()
    second = agents(start=False)
    th = threading.Thread(target=second.start, kwargs={"timeout": 30})
    th.start()
    try:
        second.wait_event("node_lock_wait", timeout=15)
        rev = await intent(client, keys, NODE, "job-p", R.SNAPSHOT, token=1)
        await asyncio.sleep(0.5)
        assert second.port == 0 and await status(client, keys, NODE, "job-p") is None   # nobody acts
        first.kill()
    finally:
        th.join(30)
    assert second.port
    st = await answered(client, keys, NODE, "job-p", rev)
    assert (st.outcome, st.state) == (R.OK, R.SNAPSHOTTED)


async def test_a_lost_agent_lease_is_replaced_and_the_key_comes_back(client, keys, agents, workers, etcd):
    agent = agents(extra=["--agent-lease-ttl", "3", "--refresh-interval", "0.5"])
    w = workers(2 * MiB)
    await register(client, keys, "job-r", NODE, w.pid)
    old = await get(client, keys.agent(NODE))
    etcd.revoke_lease(old.lease)                    # as if etcd had expired it during a partition
    deadline = time.monotonic() + 10
    while True:
        kv = await get(client, keys.agent(NODE))
        if kv is not None and kv.lease not in (0, old.lease):
            break
        assert time.monotonic() < deadline, "the agent key never came back"
        await asyncio.sleep(0.05)
    agent.wait_event("agent_session_renewed")
    rev = await intent(client, keys, NODE, "job-r", R.SNAPSHOT, token=1)
    assert (await answered(client, keys, NODE, "job-r", rev)).state == R.SNAPSHOTTED
    assert (await get(client, keys.agent(NODE))).lease == kv.lease
