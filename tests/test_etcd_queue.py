"""The FIFO queue / lock against real etcd."""
import asyncio
import json
import os
import signal
import sys
import time

import pytest

from timeslice.common.errors import SessionLost
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, FifoQueue, Session, SessionTiming, ops

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


@pytest.fixture
async def client(etcd):
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    yield c
    await c.close()


def _read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_twenty_contender_processes_fifo_no_overlap(etcd, key_prefix, tmp_path, proc_reaper):
    out = str(tmp_path / "holds.jsonl")
    prefix = key_prefix + "q/"
    procs = []
    for i in range(20):
        procs.append(proc_reaper.spawn([sys.executable, os.path.join(SCRIPTS, "contender.py"),
                                        etcd.endpoints_str, prefix, f"c{i:02d}", out, "0.02"]))
    for p in procs:
        assert p.wait(120) == 0
    recs = _read_records(out)
    assert len(recs) == 20, "every contender must be granted"
    by_start = sorted(recs, key=lambda r: r["start"])
    tokens = [r["token"] for r in by_start]
    # Grants in create-revision order: the token sequence in time order is sorted.
    assert tokens == sorted(tokens) and len(set(tokens)) == 20
    # Never two holders: each hold ends before the next starts.
    for a, b in zip(by_start, by_start[1:]):
        assert a["end"] <= b["start"], f"{a['name']} and {b['name']} held the lock at once"


async def test_sigkilled_holder_lease_expires_next_waiter_granted(etcd, key_prefix, tmp_path, client,
                                                                  proc_reaper):
    out = str(tmp_path / "holder.jsonl")
    prefix = key_prefix + "q/"
    holder = proc_reaper.spawn([sys.executable, os.path.join(SCRIPTS, "contender.py"), etcd.endpoints_str,
                                prefix, "holder", out, "3600", "2"])
    deadline = time.monotonic() + 30
    while not os.path.exists(out + ".holding"):
        assert time.monotonic() < deadline, "holder never acquired"
        await asyncio.sleep(0.05)
    holder_token = int(open(out + ".holding").read())
    async with Session(client, SessionTiming(ttl=5)) as s:
        q = FifoQueue(client, prefix.encode())
        waiting = asyncio.ensure_future(q.wait_turn(await q.enqueue("waiter", b"", s.lease_id)))
        await asyncio.sleep(0.5)
        assert not waiting.done(), "waiter must block while the holder lives"
        os.kill(holder.pid, signal.SIGKILL)
        held = await asyncio.wait_for(waiting, 30)      # after the holder's 2 s lease expires
        assert held.token > holder_token
        assert await q.remove(held)


async def test_retried_enqueue_does_not_enqueue_twice(client, key_prefix):
    q = FifoQueue(client, (key_prefix + "q/").encode())
    async with Session(client, SessionTiming(ttl=5)) as s:
        first = await q.enqueue("job", b"v", s.lease_id)
        again = await q.enqueue("job", b"v", s.lease_id)
        assert first.created and not again.created
        assert first.token == again.token
        _, entries = await q.entries()
        assert len(entries) == 1


async def test_predecessor_deleted_before_watch_starts(client, key_prefix):
    """The delete lands between the waiter's read and its watch: the watch must still see it."""
    q = FifoQueue(client, (key_prefix + "q/").encode())
    async with Session(client, SessionTiming(ttl=5)) as s:
        first = await q.enqueue("first", b"", s.lease_id)
        second = await q.enqueue("second", b"", s.lease_id)
        real_range = client.range
        deleted = []

        async def range_then_delete(req, **kw):
            resp = await real_range(req, **kw)
            if not deleted and resp.kvs and resp.kvs[0].key == first.key:
                await q.remove(first)           # after the read, before the watch is created
                deleted.append(True)
            return resp

        client.range = range_then_delete
        try:
            held = await asyncio.wait_for(q.wait_turn(second), 10)
        finally:
            client.range = real_range
        assert deleted and held.token == second.token


async def test_dead_lease_is_not_granted(client, key_prefix, etcd):
    q = FifoQueue(client, (key_prefix + "q/").encode())
    async with Session(client, SessionTiming(ttl=5)) as s1:
        s2 = await Session(client, SessionTiming(ttl=5)).open()
        await q.enqueue("holder", b"", s1.lease_id)
        entry = await q.enqueue("waiter", b"", s2.lease_id)
        task = asyncio.ensure_future(q.wait_turn(entry))
        await asyncio.sleep(0.2)
        s2.orphan()
        etcd.revoke_lease(s2.lease_id)          # the waiter's own key vanishes
        await q.remove(await q.enqueue("holder", b"", s1.lease_id))
        with pytest.raises(SessionLost):
            await asyncio.wait_for(task, 10)


async def test_remove_is_guarded_by_token(client, key_prefix):
    q = FifoQueue(client, (key_prefix + "q/").encode())
    async with Session(client, SessionTiming(ttl=5)) as s:
        old = await q.enqueue("job", b"", s.lease_id)
        assert await q.remove(old)
        new = await q.enqueue("job", b"", s.lease_id)
        assert new.token > old.token
        assert not await q.remove(old), "a stale token must not delete the newer entry"
        r = await client.range(ops.range_req(new.key))
        assert r.kvs and r.kvs[0].create_revision == new.token
