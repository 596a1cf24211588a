"""A session the client declared lost is ended at lockd as soon as the client reaches it.

During an etcd majority loss a client's keepalives fail for a whole TTL and it declares its
session lost, while etcd still holds the lease: leases do not run out without a raft leader, and
the next leader gives each one its full TTL again. Before, the abandoned queue entry then blocked
the job behind it for that TTL after every outage; now the client ends the old session
(CloseSession with ``lost``) as soon as it reaches a replica that reaches etcd, and the next job
is granted at once. Here the client is also cut from lockd until etcd is back, so the test can
see (in etcd) that the lease was still alive, with most of its TTL left, when the client came back.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from aetcd import rpc

from timeslice import AsyncOrchestratorClient
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.retry import RetryPolicy
from timeslice.testing.lockd import LockdCluster, admin_channel
from timeslice.testing.rawjob import RawJob

TTL = 6
FAST = ["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5", "--etcd-timeout", "3"]


class Relay:
    """A TCP relay to ``port`` on loopback that the test can cut and restore.

    Cut, it drops every connection and holds new ones unanswered until restored, as a partition
    would. It does not refuse them: a refused connection puts the client's channel into its
    reconnect backoff (up to 2 s, ``grpc.max_reconnect_backoff_ms``), and the client's return
    would be timed by that backoff, not by its reaction, eating the bound below. A connection
    still being set up when the cut comes is dropped too, so nothing slips through the cut.
    """

    def __init__(self, port: int):
        self.port = port
        self._open = asyncio.Event()
        self._open.set()
        self._stopped = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._writers.add(cw)
        try:
            await self._open.wait()                  # held, unanswered, while cut
            if self._stopped:
                raise ConnectionError("relay stopped")
            ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
        except (ConnectionError, asyncio.CancelledError):
            cw.close()
            self._writers.discard(cw)
            return
        self._writers.add(uw)
        if not self._open.is_set() or cw.is_closing():   # cut (or gone) while it connected
            for w in (cw, uw):
                w.close()
                self._writers.discard(w)
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                w.close()
                self._writers.discard(w)

        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    def cut(self) -> None:
        self._open.clear()
        for w in list(self._writers):
            w.close()

    def restore(self) -> None:
        self._open.set()

    async def stop(self) -> None:
        self._stopped = True
        self.cut()
        self._open.set()                             # the held ones end
        if self._server is not None:
            self._server.close()


async def _until_gone(etcd3, key: bytes, timeout: float) -> None:
    c = EtcdClient(EtcdConfig.parse(etcd3.endpoints_str))
    try:
        deadline = time.monotonic() + timeout
        while (await c.range(ops.range_req(key))).kvs:
            assert time.monotonic() < deadline, f"{key!r} still there after {timeout:.1f}s"
            await asyncio.sleep(0.05)
    finally:
        await c.close()


async def _ttl_left(etcd3, lease: int) -> int:
    """The lease's remaining TTL as etcd sees it (-1: gone)."""
    c = EtcdClient(EtcdConfig.parse(etcd3.endpoints_str))
    try:
        await c.connect()
        r = await c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease), timeout=10, metadata=c.metadata)
        return r.TTL
    finally:
        await c.close()


@pytest.mark.slow
async def test_a_session_declared_lost_in_an_etcd_outage_is_ended_once_etcd_is_back(etcd3, key_prefix, tmp_path):
    cluster = LockdCluster(etcd3.endpoints_str, key_prefix, n=1, logdir=str(tmp_path), extra=FAST).start()
    target = cluster.replicas[0].target
    relay = Relay(cluster.replicas[0].port)
    lost = asyncio.Event()
    # Short re-send backoff: what the bound below measures is the client's reaction, not its backoff cap.
    job = AsyncOrchestratorClient(await relay.start(), "holder", session_ttl=TTL, on_session_lost=lambda e: lost.set(),
                                  retry=RetryPolicy(max_backoff=0.5))
    behind = RawJob("behind", [target], ttl=60, failover=False)
    try:
        async with admin_channel(target) as ch:
            await pbg.LockdStub(ch).CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        await job.acquire("g", timeout=10)
        lease = job.lease_id
        await behind.open()
        waiting = asyncio.create_task(behind.acquire("g", timeout=120))
        async with admin_channel(target) as ch:          # queued behind the holder before the outage
            while not (await pbg.LockdStub(ch).GetGroupStatus(pb.GroupRef(group_id="g"), timeout=10)).waiters:
                await asyncio.sleep(0.02)

        leader = await asyncio.to_thread(etcd3.leader)
        down = [m for m in etcd3.members if m is not leader][:1] + [leader]
        for m in down:
            await asyncio.to_thread(m.kill)
        await asyncio.wait_for(lost.wait(), 3 * TTL)         # no keepalive for a TTL: declared lost
        assert job.session_lost
        relay.cut()                                          # ... and the client cannot reach lockd
        for m in down:
            await asyncio.to_thread(m.restart)
        await etcd3.wait_healthy_async(30)
        left = await _ttl_left(etcd3, lease)
        assert left > 1, f"etcd holds the lease the client declared lost, with its TTL renewed (left: {left})"
        assert not waiting.done()

        relay.restore()                                      # the client reaches lockd again
        # Its queue entry goes well before that lease could run out: the client ended the session.
        await _until_gone(etcd3, Keys(key_prefix).queue_entry("g", "holder"), left - 1.0)
        assert await _ttl_left(etcd3, lease) == -1
        assert (await asyncio.wait_for(waiting, 30)).job_id == "behind"
        ended = cluster.replicas[0].events("session_ended", job="holder")
        assert ended and ended[-1]["ended"] is True, ended
        # A fresh session of the job id is not refused as a duplicate of the old one.
        await job.reset_session()
        assert await job.open_session() != lease
    finally:
        await job.close()
        await behind.close()
        await relay.stop()
        cluster.stop()
