"""DeleteGroup racing an Acquire served by another replica: the holder is always told,
and nothing of a deleted group is written after its delete.

Each interleaving is held open with a gate on one replica's etcd client (tests/lockd/gated.py):
the delete stopped between its read of the queue and its delete, or the Acquire stopped between
its check of the group and its queue write. A bounded stress over three replicas then runs both
calls at once, round after round, and checks the same invariants.
"""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.lockd.conftest import Job, admin
from tests.lockd.gated import deletes_prefix, puts, replica_in_process, until
from timeslice.common.server.etcd import EtcdClient, ops
from timeslice.common.server.keys import Keys
from timeslice.lockd.errors import GroupBusy, NotFound
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing.lockd import LockdCluster


@pytest.fixture
def lockd1(etcd, key_prefix, tmp_path):
    cluster = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
    yield cluster
    cluster.stop()


async def group_keys(client: EtcdClient, keys: Keys, group: str) -> list[bytes]:
    r = await client.range(ops.range_req(keys.group(group), prefix=True, keys_only=True))
    return [kv.key for kv in r.kvs]


async def code_of(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await coro
    return ei.value.code(), ei.value.details() or ""


@pytest.mark.parametrize("force", [True, False])
async def test_a_job_granted_while_a_delete_is_under_way_is_told_or_the_delete_refused(
        etcd, key_prefix, lockd1, etcd_client, force):
    """The delete read an empty queue; before it deleted, a job was queued and granted on another
    replica. Before the fix the delete removed that hold and nobody told its holder (KeepAlive
    listed nothing, its Yield said NOT_FOUND)."""
    keys, target = Keys(key_prefix), lockd1.replicas[0].target
    ch, stub = await admin(target)
    async with ch, replica_in_process(etcd.endpoints_str, key_prefix) as rep:
        await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        await until(lambda: "g" in rep.index.groups, what="the in-process replica sees the group")
        gate = rep.client.hold(deletes_prefix(keys.group("g")))
        delete = asyncio.create_task(rep.groups.delete("g", force))
        await asyncio.wait_for(gate.reached.wait(), 10)      # the queue is read (empty); the delete waits
        job = await Job(target, "A").open()
        got = await job.acquire("g", timeout=10)             # queued and granted on the other replica
        gate.go.set()
        if force:
            assert await delete is True
            ka = await job.stub.KeepAlive(job.ref(), timeout=5)
            assert list(ka.revoked_groups) == ["g"], "the holder is told by its next keepalive"
            code, msg = await code_of(job.stub.Yield(
                pb.YieldRequest(job_id="A", session_secret=job.secret, group_id="g", token=got.token), timeout=5))
            assert code == grpc.StatusCode.ABORTED and msg.startswith("group_deleted"), (code, msg)
            assert await group_keys(etcd_client, keys, "g") == []
        else:
            with pytest.raises(GroupBusy):
                await delete
            st = await stub.GetGroupStatus(pb.GroupRef(group_id="g"), timeout=5)
            assert (st.grant.job_id, st.grant.token) == ("A", got.token), "the hold is untouched"
        await job.close()


@pytest.mark.parametrize("seq", [1, 0], ids=["numbered", "unnumbered"])
async def test_an_acquire_that_saw_the_group_before_its_delete_writes_nothing_after_it(
        etcd, key_prefix, lockd1, etcd_client, seq):
    """The Acquire checked the group, then the group was deleted (on another replica), then the
    Acquire's queue write went out. Before the fix the entry was written without a spec, the leader
    granted it, and the group created again under the name was blocked until that session ended."""
    keys, target = Keys(key_prefix), lockd1.replicas[0].target
    ch, stub = await admin(target)
    async with ch, replica_in_process(etcd.endpoints_str, key_prefix) as rep:
        await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        await until(lambda: "g" in rep.index.groups, what="the in-process replica sees the group")
        _secret, lease, _ttl = await rep.sessions.open("A", 10, "test")
        gate = rep.client.hold(puts(keys.queue_entry("g", "A")))
        acquire = asyncio.create_task(rep.locks.acquire("A", lease, "g", 0, 10.0, seq=seq))
        await asyncio.wait_for(gate.reached.wait(), 10)      # the group was checked; the write waits
        assert (await stub.DeleteGroup(pb.DeleteGroupRequest(group_id="g", force=True), timeout=10)).deleted
        gate.go.set()
        with pytest.raises(NotFound, match="unknown group"):
            await acquire
        assert await group_keys(etcd_client, keys, "g") == [], "no entry or grant outlives the delete"
        # Created again under its name, the group is free for the next job at once.
        await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        other = await Job(target, "B").open()
        assert (await other.acquire("g", timeout=10)).job_id == "B"
        await other.close()


async def test_parallel_deletes_and_acquires_over_three_replicas_keep_the_invariants(etcd, key_prefix, lockd3,
                                                                                    etcd_client):
    """Round after round, an Acquire on one replica and a forced DeleteGroup on another at once. Either
    may win, but: a job granted is always told of the delete (KeepAlive's revoked_groups), nothing of
    the group is left in etcd, and the group created again is the next job's at once."""
    keys, t = Keys(key_prefix), lockd3.targets
    rng = random.Random(25)
    outcomes: dict[str, int] = {}
    ch, stub = await admin(t[0])
    async with ch:
        _ch2, deleter = await admin(t[2])
        async with _ch2:
            for i in range(24):
                g = f"g{i}"
                await stub.CreateGroup(pb.CreateGroupRequest(group_id=g), timeout=10)
                job = await Job(t[1], f"a{i}").open()

                async def acquire(delay: float):
                    await asyncio.sleep(delay)
                    return await job.acquire(g, timeout=10)

                async def delete(delay: float):
                    await asyncio.sleep(delay)
                    return await deleter.DeleteGroup(pb.DeleteGroupRequest(group_id=g, force=True), timeout=10)

                got, deleted = await asyncio.gather(acquire(rng.uniform(0, 0.01)), delete(rng.uniform(0, 0.01)),
                                                    return_exceptions=True)
                assert not isinstance(deleted, BaseException) and deleted.deleted, deleted
                if isinstance(got, BaseException):
                    assert isinstance(got, grpc.aio.AioRpcError) and got.code() == grpc.StatusCode.NOT_FOUND, got
                    outcomes["refused"] = outcomes.get("refused", 0) + 1
                else:
                    ka = await job.stub.KeepAlive(job.ref(), timeout=5)
                    assert g in ka.revoked_groups, f"round {i}: {job.job_id} was granted {g} and never told"
                    outcomes["granted_then_told"] = outcomes.get("granted_then_told", 0) + 1
                assert await group_keys(etcd_client, keys, g) == [], f"round {i}: keys of {g} outlived its delete"
                await stub.CreateGroup(pb.CreateGroupRequest(group_id=g), timeout=10)
                nxt = await Job(t[i % 3], f"b{i}").open()
                assert (await nxt.acquire(g, timeout=10)).job_id == f"b{i}"
                for j in (job, nxt):
                    await j.close_session()
                    await j.close()
    assert sum(outcomes.values()) == 24, outcomes
