"""AsyncOrchestratorClient mirrors the sync client (pytest-asyncio, auto mode)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from timeslice import (
    AsyncOrchestratorClient,
    NotHolderError,
    SessionLostError,
    UnknownGroupError,
)


async def test_acquire_yield_fifo_and_watch(lockd, group, uid):
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"a-{uid}", session_ttl=3) as a, \
            AsyncOrchestratorClient(lockd.targets[::-1], job_id=f"b-{uid}") as b:
        updates = []
        watching = asyncio.Event()

        async def watch():
            async for st in a.watch(group, timeout=20):
                updates.append(st)
                watching.set()
                if st.grant and st.grant.job_id == b.job_id:
                    return
        w = asyncio.create_task(watch())
        await asyncio.wait_for(watching.wait(), 10)
        ga = await a.acquire(group)
        tb = asyncio.create_task(b.acquire(group, timeout=20))
        while not (await a.status(group)).waiters:
            await asyncio.sleep(0.02)
        await asyncio.sleep(4)                  # past a's TTL: its keepalive task holds the session
        assert not tb.done()
        rel = await a.release(group)
        assert rel.released
        gb = await tb
        assert gb.token > ga.token
        await asyncio.wait_for(w, 10)
        assert updates[0].holder is None and updates[-1].grant.job_id == b.job_id
        assert [j.job_id for j in await a.jobs() if j.job_id in (a.job_id, b.job_id)] == [a.job_id, b.job_id]
        await b.yield_(group)


async def test_decorator_on_async_and_plain_functions(lockd, group, uid):
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"d-{uid}") as c:
        @c.on_accelerators(group_id=group)
        async def generate(x):
            return (x, c.held[group].token)

        @c.on_accelerators(group_id=group)
        def train(x):                           # runs in a worker thread, the loop stays free
            return (x, threading.current_thread() is not threading.main_thread())

        assert asyncio.iscoroutinefunction(train)
        v, tok = await generate(1)
        assert v == 1 and tok > 0 and c.held == {}
        assert await train(2) == (2, True)
        async with c.on_accelerators(group) as grant:
            async with c.on_accelerators(group) as inner:
                assert inner.token == grant.token
            assert group in c.held
        assert c.held == {}
        with pytest.raises(TypeError), c.on_accelerators(group):
            pass


async def test_errors_and_async_session_loss_callback(etcd, lockd, group, uid):
    fired = []

    async def on_lost(err):
        fired.append(err)

    async with AsyncOrchestratorClient(lockd.targets, job_id=f"e-{uid}", on_session_lost=on_lost) as c:
        with pytest.raises(UnknownGroupError):
            await c.acquire(f"nope-{uid}")
        with pytest.raises(NotHolderError):
            await c.yield_(group)
        grant = await c.acquire(group)
        await asyncio.to_thread(etcd.revoke_lease, c.lease_id)
        with pytest.raises(SessionLostError):
            await c.yield_(group, token=grant.token)
        assert c.session_lost and len(fired) == 1
        await c.reset_session()
        await c.acquire(group)
        await c.yield_(group)


async def test_cancelled_acquire_leaves_the_queue(lockd, group, uid):
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"ca-{uid}") as a, \
            AsyncOrchestratorClient(lockd.targets, job_id=f"cb-{uid}") as b:
        await a.acquire(group)
        task = asyncio.create_task(b.acquire(group))
        while not (await a.status(group)).waiters:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not (await a.status(group)).waiters:
                break
            await asyncio.sleep(0.02)
        assert (await a.status(group)).waiters == ()
        assert not b.session_lost
        await a.yield_(group)
