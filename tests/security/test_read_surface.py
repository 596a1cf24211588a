"""lockd's read surface: ill-formed ids on every RPC, watch streams bounded per caller and in total,
reads that need a credential when the operator says so. Real lockd replicas on real etcd; two
callers are two loopback addresses (127.0.0.1, and 127.0.0.2 through a relay)."""
from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest

from tests.security.conftest import rpc_error
from tests.security.test_session_limits import from_address
from timeslice.lockd.watches import MAX_WATCHES_PER_CALLER
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.lockd import LockdCluster, admin_channel

BAD_IDS = ["../x", "a/b", "", "x" * 300, "caf\u00e9", "a b", "-lead"]


def _calls(stub, bad: str):
    """Every RPC with ``bad`` in each of its id fields (CreateGroup's node id too)."""
    s = "secret-" + "x" * 20
    yield "OpenSession", stub.OpenSession(lpb.OpenSessionRequest(job_id=bad, ttl_seconds=10), timeout=10)
    yield "CloseSession", stub.CloseSession(lpb.SessionRef(job_id=bad, session_secret=s), timeout=10)
    yield "KeepAlive", stub.KeepAlive(lpb.SessionRef(job_id=bad, session_secret=s), timeout=10)
    yield "Acquire(job)", stub.Acquire(lpb.AcquireRequest(job_id=bad, session_secret=s, group_id="g"), timeout=10)
    yield "Acquire(group)", stub.Acquire(lpb.AcquireRequest(job_id="j", session_secret=s, group_id=bad), timeout=10)
    yield "Yield(job)", stub.Yield(lpb.YieldRequest(job_id=bad, session_secret=s, group_id="g", token=1), timeout=10)
    yield "Yield(group)", stub.Yield(lpb.YieldRequest(job_id="j", session_secret=s, group_id=bad, token=1), timeout=10)
    for m in ("RegisterWorker", "UnregisterWorker"):
        yield f"{m}(job)", getattr(stub, m)(lpb.WorkerRequest(job_id=bad, session_secret=s, node="n", pid=5), timeout=10)
        yield f"{m}(node)", getattr(stub, m)(lpb.WorkerRequest(job_id="j", session_secret=s, node=bad, pid=5), timeout=10)
    yield "CreateGroup(group)", stub.CreateGroup(lpb.CreateGroupRequest(group_id=bad), timeout=10)
    yield "CreateGroup(node)", stub.CreateGroup(lpb.CreateGroupRequest(group_id="g", nodes=[lpb.NodeSpec(node=bad)]),
                                                timeout=10)
    yield "DeleteGroup", stub.DeleteGroup(lpb.DeleteGroupRequest(group_id=bad), timeout=10)
    yield "GetGroupStatus", stub.GetGroupStatus(lpb.GroupRef(group_id=bad), timeout=10)


async def _first(stream):
    async for item in stream:
        return item
    return None


async def test_ill_formed_ids_are_invalid_argument_on_every_rpc(stack):
    async with admin_channel(stack.target) as ch:
        stub = lpbg.LockdStub(ch)
        for bad in BAD_IDS:                  # an empty id is a missing one: ill-formed too
            for name, call in _calls(stub, bad):
                e = await rpc_error(call)
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, bad, e.code(), e.details())
                assert "Error" not in e.details() and len(e.details()) <= 1024, (name, e.details())
            e = await rpc_error(_first(stub.WatchGroup(lpb.GroupRef(group_id=bad), timeout=10)))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.code(), e.details())


@pytest.fixture
def lockd_with(etcd, tmp_path):
    started = []

    def start(*flags: str) -> LockdCluster:
        prefix = f"/reads-{secrets.token_hex(4)}/"
        c = LockdCluster(etcd.endpoints_str, prefix, n=1, logdir=str(tmp_path), extra=list(flags)).start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


async def _group(target: str) -> None:
    async with admin_channel(target) as ch:
        await lpbg.LockdStub(ch).CreateGroup(lpb.CreateGroupRequest(group_id="w"), timeout=10)


async def _watching(stub, group: str = "w") -> grpc.aio.UnaryStreamCall:
    """A watch whose first update has arrived (so the server has admitted it)."""
    call = stub.WatchGroup(lpb.GroupRef(group_id=group))
    first = await asyncio.wait_for(call.read(), 10)
    assert first is not grpc.aio.EOF
    return call


async def test_watches_are_bounded_per_caller_and_in_total(lockd_with):
    c = lockd_with("--max-watches", "5", "--max-watches-per-caller", "3")
    port = c.replicas[0].port
    await _group(c.replicas[0].target)
    async with from_address("127.0.0.2", port) as other, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{other}") as b:
        sa, sb = lpbg.LockdStub(a), lpbg.LockdStub(b)
        mine = [await _watching(sa) for _ in range(3)]
        e = await rpc_error(_first(sa.WatchGroup(lpb.GroupRef(group_id="w"), timeout=10)))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert "limit max_watches_per_caller" in e.details() and "ipv4:127.0.0.1 has 3" in e.details(), e.details()
        theirs = [await _watching(sb) for _ in range(2)]          # another caller has its own count...
        e = await rpc_error(_first(sb.WatchGroup(lpb.GroupRef(group_id="w"), timeout=10)))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit max_watches: 5" in e.details(), e.details()
        mine[0].cancel()                                          # ...and a closed watch frees its place
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                mine[0] = await _watching(sa)
                break
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert asyncio.get_running_loop().time() < deadline, "the cancelled watch's place never came back"
                await asyncio.sleep(0.05)
        for w in mine + theirs:
            w.cancel()


async def test_reads_need_a_credential_when_the_operator_says_so(lockd_with):
    c = lockd_with("--require-read-auth")
    target = c.replicas[0].target
    await _group(target)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = lpbg.LockdStub(ch)
        for call in (stub.ListGroups(lpb.ListGroupsRequest(), timeout=10),
                     stub.GetGroupStatus(lpb.GroupRef(group_id="w"), timeout=10),
                     stub.ListJobs(lpb.ListJobsRequest(), timeout=10),
                     _first(stub.WatchGroup(lpb.GroupRef(group_id="w"), timeout=10))):
            e = await rpc_error(call)
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "credential" in e.details(), e
    async with admin_channel(target, token="not-the-token-" + "y" * 20) as ch:
        e = await rpc_error(lpbg.LockdStub(ch).ListGroups(lpb.ListGroupsRequest(), timeout=10))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    async with admin_channel(target) as ch:
        stub = lpbg.LockdStub(ch)
        await stub.ListGroups(lpb.ListGroupsRequest(), timeout=10)
        await stub.ListJobs(lpb.ListJobsRequest(), timeout=10)
        w = await _watching(stub)
        w.cancel()
    # Off (the default), anyone reads.
    c2 = lockd_with()
    async with grpc.aio.insecure_channel(c2.replicas[0].target) as ch:
        await lpbg.LockdStub(ch).ListGroups(lpb.ListGroupsRequest(), timeout=10)


async def test_a_watch_of_an_ill_formed_group_is_invalid_argument_not_unknown(stack):
    async with grpc.aio.insecure_channel(stack.target) as ch:
        e = await rpc_error(_first(lpbg.LockdStub(ch).WatchGroup(lpb.GroupRef(group_id="../x"), timeout=10)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "ill-formed" in e.details(), (e.code(), e.details())


async def test_anonymous_watches_are_bounded_by_default(stack):
    async with admin_channel(stack.target) as ch:
        try:
            await lpbg.LockdStub(ch).CreateGroup(lpb.CreateGroupRequest(group_id="w"), timeout=10)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    async with grpc.aio.insecure_channel(stack.target) as ch:
        stub = lpbg.LockdStub(ch)
        open_ = [await _watching(stub) for _ in range(MAX_WATCHES_PER_CALLER)]
        e = await rpc_error(_first(stub.WatchGroup(lpb.GroupRef(group_id="w"), timeout=10)))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_watches_per_caller" in e.details()
        for w in open_:
            w.cancel()
