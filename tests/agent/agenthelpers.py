"""etcd helpers for the agent tests: write what the leader and lockd would write, wait for answers."""
from __future__ import annotations

import asyncio
import time

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.keys import Keys

MiB = 1 << 20
NODE = "node-a"


async def put(client, key: bytes, value: bytes) -> int:
    """A plain put; returns its revision (= the key's new mod_revision)."""
    resp = await client.txn([], [ops.put(key, value)])
    return resp.header.revision


async def get(client, key: bytes):
    r = await client.range(ops.range_req(key))
    return r.kvs[0] if r.kvs else None


async def register(client, keys: Keys, job: str, node: str, pid: int, nbytes: int = 0) -> None:
    await put(client, keys.worker(job, node, pid), R.WorkerValue(pid, node, nbytes, R.now_ms()).dump())


async def intent(client, keys: Keys, node: str, job: str, op: str, token: int, group: str = "g",
                 epoch: int = 1) -> int:
    """Write an intent as the leader does (a plain put here); returns its mod_revision."""
    val = R.IntentValue(op, job, group, token, epoch, R.now_ms())
    return await put(client, keys.intent(node, job), val.dump())


async def status(client, keys: Keys, node: str, job: str) -> R.StatusValue | None:
    kv = await get(client, keys.status(node, job))
    return R.StatusValue.load(kv.value) if kv else None


async def agent_value(client, keys: Keys, node: str) -> R.AgentValue | None:
    kv = await get(client, keys.agent(node))
    return R.AgentValue.load(kv.value) if kv else None


async def wait_status(client, keys: Keys, node: str, job: str, pred, timeout: float = 10.0) -> R.StatusValue:
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = await status(client, keys, node, job)
        if st is not None and pred(st):
            return st
        await asyncio.sleep(0.02)
    raise AssertionError(f"status of {job} on {node} never matched; last: {st}")


async def answered(client, keys: Keys, node: str, job: str, revision: int, timeout: float = 10.0) -> R.StatusValue:
    """The status once it answers the intent written at ``revision`` (what the leader waits for)."""
    return await wait_status(client, keys, node, job,
                             lambda s: s.intent_revision == revision and s.outcome != "", timeout)


async def wait_agent(client, keys: Keys, node: str, pred, timeout: float = 10.0) -> R.AgentValue:
    deadline = time.monotonic() + timeout
    a = None
    while time.monotonic() < deadline:
        a = await agent_value(client, keys, node)
        if a is not None and pred(a):
            return a
        await asyncio.sleep(0.02)
    raise AssertionError(f"agent key of {node} never matched; last: {a}")
