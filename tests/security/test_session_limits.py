"""Live sessions are bounded: per caller and in total, each past
the limit refused with RESOURCE_EXHAUSTED naming it, nothing written to etcd; closing one frees a
place. A real lockd on real etcd; two callers are two loopback addresses (127.0.0.1, and 127.0.0.2 through a
relay)."""
from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager

import grpc
import pytest
from aetcd import rpc

from tests.security.conftest import rpc_error
from timeslice.common.errors import ConfigError
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.lockd.callers import peer_address as address
from timeslice.lockd.sessions import SessionLimits
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.lockd import LockdCluster


async def _state(etcd, prefix: str) -> dict:
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    await c.connect()
    try:
        r = await c.range(ops.range_req(prefix.encode(), prefix=True))
        # Every lease in etcd too: a refused OpenSession must not leave one behind.
        leases = await c.leasestub.LeaseLeases(rpc.LeaseLeasesRequest(), timeout=5, metadata=c.metadata)
        return {"keys": {kv.key: kv.mod_revision for kv in r.kvs if b"/jobs/" in kv.key},
                "leases": {lease.ID for lease in leases.leases}}
    finally:
        await c.close()


def unchanged(before: dict, after: dict) -> bool:
    """The job keys are as they were and no lease was added (others may expire meanwhile)."""
    return after["keys"] == before["keys"] and not after["leases"] - before["leases"]


@pytest.fixture
def lockd_with(etcd, tmp_path):
    started = []

    def start(*flags: str) -> tuple[str, int]:
        prefix = f"/lim-{secrets.token_hex(4)}/"
        c = LockdCluster(etcd.endpoints_str, prefix, n=1, logdir=str(tmp_path), extra=list(flags)).start()
        started.append(c)
        return prefix, c.replicas[0].port

    yield start
    for c in started:
        c.stop()


@asynccontextmanager
async def from_address(source: str, port: int):
    """A local port whose connections reach lockd from ``source`` (another loopback address): a
    second caller on this machine (the kernel picks 127.0.0.1 as the source of any loopback dial)."""
    async def pipe(r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def serve(cr, cw):
        ur, uw = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def _open(stub, job: str):
    return await stub.OpenSession(lpb.OpenSessionRequest(job_id=job, ttl_seconds=30), timeout=10)


async def test_sessions_per_caller_are_bounded_and_other_callers_are_not_counted(etcd, lockd_with):
    prefix, port = lockd_with("--max-sessions", "10", "--max-sessions-per-peer", "3")
    async with from_address("127.0.0.2", port) as other, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{other}") as b:
        sa, sb = lpbg.LockdStub(a), lpbg.LockdStub(b)
        opened = [await _open(sa, f"a{i}") for i in range(3)]
        before = await _state(etcd, prefix)
        e = await rpc_error(_open(sa, "a3"))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit max_sessions_per_peer" in e.details() and "ipv4:127.0.0.1 has 3" in e.details()
        assert unchanged(before, await _state(etcd, prefix))                     # nothing written
        for i in range(3):
            await _open(sb, f"b{i}")                                   # another caller has its own count
        # Closing a session frees its place.
        await sa.CloseSession(lpb.SessionRef(job_id="a0", session_secret=opened[0].session_secret), timeout=10)
        await _open(sa, "a3")


async def test_live_sessions_are_bounded_in_total(etcd, lockd_with):
    prefix, port = lockd_with("--max-sessions", "4", "--max-sessions-per-peer", "3")
    async with from_address("127.0.0.2", port) as other, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{other}") as b:
        sa, sb = lpbg.LockdStub(a), lpbg.LockdStub(b)
        for i in range(3):
            await _open(sa, f"a{i}")
        await _open(sb, "b0")
        before = await _state(etcd, prefix)
        e = await rpc_error(_open(sb, "b1"))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit max_sessions: 4 live sessions" in e.details()
        assert unchanged(before, await _state(etcd, prefix))


def test_session_limit_flags_are_validated():
    with pytest.raises(ConfigError, match="--max-sessions must be >= 1"):
        SessionLimits(max_sessions=0)
    with pytest.raises(ConfigError, match=r"--max-sessions-per-peer must be in 1\.\.--max-sessions"):
        SessionLimits(max_sessions=10, max_per_peer=11)
    with pytest.raises(ConfigError, match="--max-sessions-per-peer"):
        SessionLimits(max_per_peer=0)


def test_a_callers_address_is_its_host_without_the_port():
    assert address("ipv4:10.0.3.7:51234") == "ipv4:10.0.3.7"
    assert address("ipv6:[fd00::7]:51234") == "ipv6:fd00::7"
    assert address("ipv6:%5B::1%5D:50051") == "ipv6:::1"
    assert address("unix:/run/timeslice/lockd.sock") == "unix:local"
    assert len(address("ipv4:" + "9" * 1000)) <= 160
