"""A session is lost only when etcd says so: a client keeps it through an etcd outage.

During an etcd majority loss a client's keepalives fail for a whole TTL while etcd still holds the
lease: leases do not run out without a raft leader, and the next leader gives each one its full TTL
again. Before, the client declared its session lost on its own at that point, and then ended it at
lockd (CloseSession with ``lost``) once a replica answered, deleting a lease etcd had kept: the job
lost its hold and its places for nothing. Now the session is only in doubt until an answer comes:
kept if etcd kept the lease, lost if etcd says it is gone. Here the client is also cut from lockd
until etcd is back, so the test can see (in etcd) that the lease is alive when the client returns.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from aetcd import rpc

from timeslice import AsyncOrchestratorClient
from timeslice.common.server.etcd import EtcdClient, EtcdConfig
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


async def _ttl_left(etcd3, lease: int) -> int:
    """The lease's remaining TTL as etcd sees it (-1: gone)."""
    c = EtcdClient(EtcdConfig.parse(etcd3.endpoints_str))
    try:
        await c.connect()
        r = await c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease), timeout=10, metadata=c.metadata)
        return r.TTL
    finally:
        await c.close()


async def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_session_is_kept_through_an_etcd_majority_loss(etcd3, key_prefix, tmp_path):
    cluster = LockdCluster(etcd3.endpoints_str, key_prefix, n=1, logdir=str(tmp_path), extra=FAST).start()
    target = cluster.replicas[0].target
    relay = Relay(cluster.replicas[0].port)
    fired: list = []
    job = AsyncOrchestratorClient(await relay.start(), "holder", session_ttl=TTL, on_session_lost=fired.append,
                                  retry=RetryPolicy(max_backoff=0.5))
    behind = RawJob("behind", [target], ttl=60, failover=False)
    try:
        async with admin_channel(target) as ch:
            await pbg.LockdStub(ch).CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        held = await job.acquire("g", timeout=10)
        lease = job.lease_id
        await behind.open()
        waiting = asyncio.create_task(behind.acquire("g", timeout=180))
        async with admin_channel(target) as ch:          # queued behind the holder before the outage
            while not (await pbg.LockdStub(ch).GetGroupStatus(pb.GroupRef(group_id="g"), timeout=10)).waiters:
                await asyncio.sleep(0.02)

        leader = await asyncio.to_thread(etcd3.leader)
        down = [*[m for m in etcd3.members if m is not leader][:1], leader]
        for m in down:
            await asyncio.to_thread(m.kill)
        # A TTL without an answered keepalive: in doubt (an older client declared the loss here).
        await _until(lambda: bool(fired) or getattr(job, "session_in_doubt", False), 3 * TTL,
                     "no keepalive answered for a TTL")
        assert not fired, f"declared lost while etcd holds the lease: {fired}"
        relay.cut()                                          # ... and the client cannot reach lockd
        await asyncio.sleep(TTL / 2)                         # in doubt for longer still, cut off
        assert not job.session_lost and not fired, f"declared lost while etcd holds the lease: {fired}"
        for m in down:
            await asyncio.to_thread(m.restart)
        await etcd3.wait_healthy_async(30)
        left = await _ttl_left(etcd3, lease)
        assert left > 1, f"etcd kept the lease through the outage, its TTL renewed (left: {left})"

        relay.restore()                                      # the client reaches lockd again
        await _until(lambda: not job.session_in_doubt, 3 * TTL, "the keepalive got through again")
        assert not job.session_lost and not fired, fired
        assert await _ttl_left(etcd3, lease) > 1
        # Still the holder, with its token; the job behind still waits, then gets it at the Yield.
        assert job.held["g"].token == held.token and not waiting.done()
        await job.yield_("g")
        assert (await asyncio.wait_for(waiting, 30)).job_id == "behind"
        assert not cluster.replicas[0].events("session_ended", job="holder"), "the client ended its own session"
    finally:
        await job.close()
        await behind.close()
        await relay.stop()
        cluster.stop()


@pytest.mark.slow
async def test_a_session_etcd_let_expire_while_the_client_was_cut_off_is_lost_when_it_is_back(
        etcd3, key_prefix, tmp_path):
    cluster = LockdCluster(etcd3.endpoints_str, key_prefix, n=1, logdir=str(tmp_path), extra=FAST).start()
    target = cluster.replicas[0].target
    relay = Relay(cluster.replicas[0].port)
    fired: list = []
    job = AsyncOrchestratorClient(await relay.start(), "holder", session_ttl=TTL, on_session_lost=fired.append,
                                  retry=RetryPolicy(max_backoff=0.5))
    behind = RawJob("behind", [target], ttl=60, failover=False)
    try:
        async with admin_channel(target) as ch:
            await pbg.LockdStub(ch).CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        await job.acquire("g", timeout=10)
        lease = job.lease_id
        await behind.open()
        waiting = asyncio.create_task(behind.acquire("g", timeout=120))
        relay.cut()                                          # etcd is fine: the lease runs out
        assert (await asyncio.wait_for(waiting, 4 * TTL)).job_id == "behind"
        assert await _ttl_left(etcd3, lease) == -1
        assert not fired                                     # nobody could tell the client yet
        relay.restore()
        await _until(lambda: bool(fired), 3 * TTL, "the client hears that its session is gone")
        assert job.session_lost and "ABORTED" in str(getattr(fired[0], "code", "")) + str(fired[0]), fired
        await job.reset_session()
        assert await job.open_session() != lease
    finally:
        await job.close()
        await behind.close()
        await relay.stop()
        cluster.stop()
