"""Profiles of 3 real lockd replicas on real etcd: GetProfiles read off the leader's history of
holds (readable with etcdctl), and a leader failover that loses none of it."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from tests.lockd.conftest import Job, admin
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing.lockd import LockdCluster


@pytest.fixture
def lockd3p(etcd, key_prefix, tmp_path):
    cluster = LockdCluster(etcd.endpoints_str, key_prefix, n=3, logdir=str(tmp_path),
                           extra=["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5"])
    cluster.start()
    yield cluster
    cluster.stop()


async def phases(job: Job, n: int, hold_s: float = 0.1, gap_s: float = 0.15) -> None:
    for _ in range(n):
        g = await job.acquire("g")
        await asyncio.sleep(hold_s)
        await job.yield_("g", g.token)
        await asyncio.sleep(gap_s)


async def profile_when(stub, job: str, pred, timeout: float = 20.0) -> pb.Profile:
    deadline = time.monotonic() + timeout
    while True:
        rep = await stub.GetProfiles(pb.ProfilesRequest(job_id=job), timeout=5)
        if rep.profiles and pred(rep.profiles[0]):
            return rep.profiles[0]
        assert time.monotonic() < deadline, f"profile of {job} never matched: {rep}"
        await asyncio.sleep(0.1)


async def test_profiles_are_recorded_stored_and_survive_a_leader_failover(lockd3p, etcd, key_prefix):
    leader, epoch = lockd3p.leader(etcd)
    follower, other = [r.target for r in lockd3p.replicas if r is not leader]
    ch, stub = await admin(other)
    await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"))
    job = await Job(follower, "pj").open()
    await phases(job, 3)
    p = await profile_when(stub, "pj", lambda p: len(p.hold_ms) >= 3)
    assert p.group_id == "g" and p.grants == 3 and p.live
    assert all(h >= 100 for h in p.hold_ms)           # each hold spans the job's 0.1 s on the GPU
    assert len(p.gap_ms) == 2 and all(g >= 100 for g in p.gap_ms) and len(p.wait_ms) == 3

    # Read off the history of holds in etcd, plain JSON under the prefix.
    lines = etcd.etcdctl("get", "--prefix", f"{key_prefix}history/g/", "--print-value-only").split()
    recs = [json.loads(x) for x in lines if x.strip()]
    assert [r["released_ms"] - r["granted_ms"] for r in recs if r["job"] == "pj"] == list(p.hold_ms)

    leader.kill()
    _, new_epoch = lockd3p.leader(etcd, timeout=30)
    assert new_epoch != epoch
    await phases(job, 2)
    after = await profile_when(stub, "pj", lambda q: len(q.hold_ms) >= 5)
    assert list(after.hold_ms[:3]) == list(p.hold_ms)   # the new leader started from what etcd held
    assert after.grants == 5 and len(after.gap_ms) >= 3 # and went on measuring (gaps across the failover too)
    await job.close()
    await ch.close()


async def test_bad_ids_are_invalid_argument(lockd3p):
    ch, stub = await admin(lockd3p.targets[0])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GetProfiles(pb.ProfilesRequest(job_id="bad id!"), timeout=5)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    await ch.close()


async def test_a_bad_reported_hold_is_invalid_argument_and_changes_nothing(lockd3p):
    t = lockd3p.targets[0]
    ch, stub = await admin(t)
    await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"))
    job = await Job(t, "pbad").open()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Acquire(pb.AcquireRequest(job_id="pbad", session_secret=job.secret, group_id="g",
                                             last_hold_ms=-1), timeout=5)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "last_hold_ms" in e.value.details()
    st = await stub.GetGroupStatus(pb.GroupRef(group_id="g"), timeout=5)
    assert not st.holder.job_id                          # nothing was queued
    await job.close()
    await ch.close()
