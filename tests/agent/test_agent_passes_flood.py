"""The agent's fence and refresh passes survive a flood of registrations.

Both passes look at every registered process in a worker thread, and looking a process up
read the agent's jobs mirror, which the event loop changes with every watch event: under a
registration flood the passes failed with "dictionary changed size during iteration"
(fence_failed, refresh_failed), and the fence is what the leader waits for before granting
past a lost holder.
"""
from __future__ import annotations

import asyncio

from agenthelpers import NODE, MiB, register, wait_agent

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops

FLOOD_KEYS = 1000      # registrations made (and the previous round's removed) each round
LOCAL = 100            # of them on this agent's node (the rest on another): the passes look at these


async def test_fence_and_refresh_passes_do_not_fail_under_a_registration_flood(client, keys, agents, workers):
    agent = agents()
    real = workers(2 * MiB, seed=3)
    lease, _ttl = await client.grant_lease(60)
    stop = asyncio.Event()

    async def batch(op_list) -> None:
        # 100 operations per transaction (etcd's --max-txn-ops is 128): each is one watch event batch.
        for i in range(0, len(op_list), 100):
            await client.txn([], op_list[i:i + 100])

    async def flood() -> int:
        # Processes that do not exist, registered and removed again: the mirror grows and shrinks
        # under the passes all the time, as it does while many jobs start at once.
        rounds, previous = 0, []
        while not stop.is_set():
            base = 3_000_000 + (rounds % 2) * 100_000
            made = [(NODE if i < LOCAL else "node-b", base + i) for i in range(FLOOD_KEYS)]
            await batch([ops.put(keys.worker("flood", n, p), R.WorkerValue(p, n, 0, R.now_ms()).dump(), lease)
                         for n, p in made])
            await batch([ops.delete(keys.worker("flood", n, p)) for n, p in previous])
            previous, rounds = made, rounds + 1
        return rounds

    flooding = asyncio.create_task(flood())
    try:
        # Passes complete while the flood goes on: a worker registered now is reported resident.
        await asyncio.sleep(1.0)
        await register(client, keys, "real", NODE, real.pid, 2 * MiB)
        await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("real", 0) > 0, timeout=30)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        rounds = await flooding
    assert rounds >= 3, rounds
    failed = [ev for name in ("fence_failed", "refresh_failed") for ev in agent.events(name)]
    assert not failed, failed[:3]
    await client.revoke(lease)
