"""Acquire attempts are ordered by the client's attempt_seq, not by when a replica
processes them: a stale attempt delivered late never takes over a
newer one, and never re-enqueues a job that has yielded since (a ghost holder)."""
import asyncio

import grpc
import pytest

from tests.lockd.conftest import Job
from tests.lockd.test_lockd_api import make_group, status
from timeslice.proto import lockd_pb2 as pb


def req(job: Job, group: str, seq: int) -> pb.AcquireRequest:
    return pb.AcquireRequest(job_id=job.job_id, session_secret=job.secret, group_id=group, attempt_seq=seq)


async def test_stale_attempt_neither_takes_over_nor_reacquires(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    job = await Job(t[1], "j").open()
    late = Job(t[2], "j")                       # the same job, reached through another replica
    late.secret = job.secret
    try:
        granted = await job.stub.Acquire(req(job, "g", 5), timeout=10)
        # A stale attempt (seq 3) delivered after seq 5 was served: refused, and the hold is untouched.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await late.stub.Acquire(req(job, "g", 3), timeout=10)
        assert e.value.code() == grpc.StatusCode.CANCELLED and "stale" in e.value.details()
        st = await status(stub)
        assert st.holder.job_id == "j" and st.holder.token == granted.token
        # A newer attempt finds its own grant (the entry is the same: same token).
        again = await late.stub.Acquire(req(job, "g", 6), timeout=10)
        assert again.token == granted.token
        await job.yield_("g", granted.token)
        # After the yield, a stale attempt must not enqueue the job again.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await late.stub.Acquire(req(job, "g", 4), timeout=10)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        st = await status(stub)
        assert not st.holder.job_id and not st.waiters, f"a stale attempt left a ghost: {st}"
        # The next real acquire (a larger number) works as usual, with a newer token.
        nxt = await job.stub.Acquire(req(job, "g", 7), timeout=10)
        assert nxt.token > granted.token
        await job.yield_("g", nxt.token)
    finally:
        await job.close()
        await late.close()
        await ch.close()


async def test_stale_attempt_of_a_waiter_cannot_steal_the_newer_call(lockd3):
    """The waiter's newer attempt stays the one that is granted; the older is refused at once."""
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    holder = await Job(t[0], "h").open()
    waiter = await Job(t[1], "w").open()
    other = Job(t[2], "w")
    other.secret = waiter.secret
    try:
        hg = await holder.acquire("g")
        newer = asyncio.ensure_future(waiter.stub.Acquire(req(waiter, "g", 10), timeout=30))
        while not (await status(stub)).waiters:
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await other.stub.Acquire(req(waiter, "g", 9), timeout=10)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert not newer.done()                     # the live call was not superseded
        await holder.yield_("g", hg.token)
        got = await newer
        assert (await status(stub)).holder.token == got.token
        await waiter.yield_("g", got.token)
    finally:
        for j in (holder, waiter, other):
            await j.close()
        await ch.close()
