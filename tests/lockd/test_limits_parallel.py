"""Count limits hold under parallel callers over several replicas.

Checked on a replica's mirror and then written, a limit was a race: 2,348 parallel OpenSession
calls of one caller (48 at a time over 3 replicas) left 2,075 live sessions against
--max-sessions-per-peer 2,048, and 3,000 parallel RegisterWorker calls of one job stored 283
workers against 256. Now each counted thing holds a slot in etcd (lockd/slots.py). The limits
here are small, set by flags, so many more callers than places race for them.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.security.test_session_limits import from_address
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.testing.lockd import LockdCluster

PARALLEL = 16            # calls in flight at once, spread over the replicas


@pytest.fixture
def limited(etcd, key_prefix, tmp_path):
    started = []

    def start(*flags: str) -> LockdCluster:
        c = LockdCluster(etcd.endpoints_str, key_prefix, n=3, logdir=str(tmp_path), extra=list(flags)).start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


async def _count(etcd, prefix: bytes) -> int:
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    try:
        return (await c.range(ops.range_req(prefix, prefix=True, count_only=True))).count
    finally:
        await c.close()


async def _in_parallel(calls) -> list:
    """Run the coroutine factories ``calls``, PARALLEL at a time; their results or errors."""
    sem = asyncio.Semaphore(PARALLEL)

    async def one(make):
        async with sem:
            try:
                return await make()
            except grpc.aio.AioRpcError as e:
                return e

    return await asyncio.gather(*(one(c) for c in calls))


def _refusals(results, limit_name: str) -> int:
    bad = [r for r in results if isinstance(r, grpc.aio.AioRpcError)
           and not (r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit {limit_name}" in (r.details() or ""))]
    assert not bad, [(r.code(), r.details()) for r in bad[:3]]
    return sum(isinstance(r, grpc.aio.AioRpcError) for r in results)


async def test_parallel_opens_from_two_callers_over_three_replicas_stop_at_both_limits(etcd, key_prefix, limited):
    cluster = limited("--max-sessions", "20", "--max-sessions-per-peer", "12")
    ports = [r.port for r in cluster.replicas]
    keys = Keys(key_prefix)
    async with from_address("127.0.0.2", ports[0]) as b0, from_address("127.0.0.2", ports[1]) as b1, \
            from_address("127.0.0.2", ports[2]) as b2:
        chans = {who: [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ps]
                 for who, ps in (("a", ports), ("b", [b0, b1, b2]))}
        try:
            stubs = {who: [pbg.LockdStub(ch) for ch in cs] for who, cs in chans.items()}

            def opens(who: str, n: int):
                return [lambda i=i: stubs[who][i % 3].OpenSession(
                    pb.OpenSessionRequest(job_id=f"{who}{i}", ttl_seconds=60), timeout=30) for i in range(n)]

            first = await _in_parallel(opens("a", 60))
            assert 60 - _refusals(first, "max_sessions_per_peer") == 12, "one caller gets exactly its 12 places"
            assert await _count(etcd, keys.jobs()) == 12
            second = await _in_parallel(opens("b", 60))
            assert 60 - _refusals(second, "max_sessions") == 8, "the other gets what is left of the 20"
            assert await _count(etcd, keys.jobs()) == 20
            assert await _count(etcd, keys.slots("sessions")) == 20
            # Closing one frees its place, for that caller, on any replica.
            won = next(r for r in first if isinstance(r, pb.OpenSessionReply))
            await stubs["a"][1].CloseSession(pb.SessionRef(job_id=won.job_id, session_secret=won.session_secret),
                                             timeout=10)
            again = await stubs["a"][2].OpenSession(pb.OpenSessionRequest(job_id="a-again", ttl_seconds=60),
                                                    timeout=10)
            assert again.session_secret
        finally:
            for cs in chans.values():
                for ch in cs:
                    await ch.close()


async def test_parallel_registrations_of_one_job_over_three_replicas_stop_at_its_limit(etcd, key_prefix, limited):
    cluster = limited("--max-workers-per-job", "16")
    keys = Keys(key_prefix)
    chans = [grpc.aio.insecure_channel(t) for t in cluster.targets]
    try:
        stubs = [pbg.LockdStub(ch) for ch in chans]
        s = await stubs[0].OpenSession(pb.OpenSessionRequest(job_id="hoarder", ttl_seconds=60), timeout=10)

        def reg(i: int):
            return lambda: stubs[i % 3].RegisterWorker(pb.WorkerRequest(
                job_id="hoarder", session_secret=s.session_secret, node="elsewhere", pid=3_000_000 + i), timeout=30)

        results = await _in_parallel([reg(i) for i in range(200)])
        assert 200 - _refusals(results, "max_workers_per_job") == 16
        assert await _count(etcd, keys.workers("hoarder")) == 16
        # Re-registering a worker it has keeps its place; unregistering one frees it, on any replica.
        kept = next(i for i, r in enumerate(results) if isinstance(r, pb.WorkerReply))
        await reg(kept)()
        assert await _count(etcd, keys.slots("workers/hoarder")) == 16
        await stubs[1].UnregisterWorker(pb.WorkerRequest(job_id="hoarder", session_secret=s.session_secret,
                                                         node="elsewhere", pid=3_000_000 + kept), timeout=10)
        assert await _count(etcd, keys.slots("workers/hoarder")) == 15
        await stubs[2].RegisterWorker(pb.WorkerRequest(job_id="hoarder", session_secret=s.session_secret,
                                                       node="elsewhere", pid=3_999_999), timeout=10)
        assert await _count(etcd, keys.workers("hoarder")) == 16
    finally:
        for ch in chans:
            await ch.close()
