"""The gRPC servicer: proto in, a call to the room that owns the request, proto out.

Every error the rooms raise is a TimesliceError carrying the name of its gRPC status;
``rpc`` / ``stream_rpc`` (common/server/serving.py) map it in one place, so a client always
gets a precise status and a message that says what to do. What is left here is per call:
the ids first (``unary``: ``job_id``, ``group_id`` and ``node`` follow the grammar of
``timeslice.common.ids``, empty is ill-formed, so a bad one is INVALID_ARGUMENT on every
RPC, never a session error first nor an exception escaping a stream), the session check,
the tenancy check before anything is written, an Acquire's deadline and its metrics and
span. The reads are ``lockd/reads.py``'s.
"""
from __future__ import annotations

import asyncio
import functools
import time

from timeslice.common.errors import LockError, TimesliceError
from timeslice.common.ids import check_id
from timeslice.common.server.serving import rpc, stream_rpc
from timeslice.lockd import traces
from timeslice.lockd.callers import Callers, peer_identity
from timeslice.lockd.errors import NotFound
from timeslice.lockd.groups import Groups, priorities_of
from timeslice.lockd.locks import Locks
from timeslice.lockd.metrics import LockdMetrics
from timeslice.lockd.reads import Reads
from timeslice.lockd.revocations import RevocationNotices
from timeslice.lockd.sessions import JobSessions
from timeslice.lockd.tenancy import Tenancy, check_tenants
from timeslice.lockd.workers import WorkerRegistry
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

_MARGIN = 0.05   # seconds kept back from the caller's deadline to remove our waiter in time
ID_FIELDS = {"job_id": "job", "group_id": "group", "node": "node"}


def check_ids(req) -> None:
    """Raise ``InvalidIdError`` for the first ill-formed id field of ``req``."""
    present = req.DESCRIPTOR.fields_by_name
    for field, kind in ID_FIELDS.items():
        if field in present:
            check_id(kind, getattr(req, field))


def unary(fn):
    """Decorator for a unary servicer method: its request's ids checked first, its errors mapped (``rpc``)."""
    @functools.wraps(fn)
    async def ids_checked(self, req, context):
        check_ids(req)
        return await fn(self, req, context)
    return rpc(ids_checked)


class LockdServicer(pbg.LockdServicer):
    def __init__(self, sessions: JobSessions, revocations: RevocationNotices, tenancy: Tenancy, callers: Callers,
                 locks: Locks, groups: Groups, workers: WorkerRegistry, reads: Reads, metrics: LockdMetrics,
                 replica_id: str):
        self.sessions, self.revocations, self.tenancy, self.callers = sessions, revocations, tenancy, callers
        self.locks, self.groups, self.workers, self.reads = locks, groups, workers, reads
        self.metrics, self.replica_id = metrics, replica_id

    @unary
    async def OpenSession(self, req, context):
        tenant = self.tenancy.session_tenant(self.callers.of(context))
        secret, lease, ttl = await self.sessions.open(req.job_id, req.ttl_seconds, peer_identity(context), tenant)
        return pb.OpenSessionReply(job_id=req.job_id, session_secret=secret, lease_id=lease, ttl_seconds=ttl)

    @unary
    async def CloseSession(self, req, context):
        return pb.CloseSessionReply(closed=await self.sessions.close(req.job_id, req.session_secret, req.lost))

    @unary
    async def KeepAlive(self, req, context):
        ttl = await self.sessions.keepalive(req.job_id, req.session_secret)
        # A holder learns here, within a keepalive period, that its group was deleted under it.
        revoked = await self.revocations.pending(req.job_id)
        return pb.KeepAliveReply(ttl_seconds=ttl, revoked_groups=revoked)

    @unary
    async def Acquire(self, req, context):
        t0 = time.monotonic()
        lease = await self.sessions.verify(req.job_id, req.session_secret)
        await self.tenancy.check_acquire(req.job_id, req.group_id)      # before anything is written
        remaining = context.time_remaining()
        timeout = None if remaining is None else max(0.0, remaining - _MARGIN - (time.monotonic() - t0))
        try:
            with traces.acquire_span(context, req, self.replica_id) as span:   # no-op unless tracing
                got = await self.locks.acquire(req.job_id, lease, req.group_id, req.device_bytes_hint, timeout,
                                                 seq=req.attempt_seq, last_hold_ms=req.last_hold_ms,
                                                 priority=req.priority, peak_bytes=req.peak_bytes,
                                                 context_bytes=req.context_bytes, exclusive=req.exclusive)
                traces.granted(span, got)
        except TimesliceError as e:
            self.metrics.acquires.labels(type(e).__name__).inc()
            raise
        except asyncio.CancelledError:
            self.metrics.acquires.labels("cancelled").inc()
            raise
        self.metrics.acquires.labels("granted").inc()
        self.metrics.acquire_wait.observe(got.waited_ms / 1000)
        g = got.grant
        return pb.AcquireReply(group_id=req.group_id, job_id=req.job_id, token=got.token,
                               leader_epoch=g.leader_epoch, waited_ms=got.waited_ms, restored=g.restored,
                               elided=g.elided, bytes_moved=g.bytes_moved, footprint_bytes=g.footprint,
                               exclusive=g.exclusive, backfilled=g.backfilled)

    @unary
    async def Yield(self, req, context):
        await self.sessions.verify(req.job_id, req.session_secret)
        try:
            released, deferred = await self.locks.yield_(req.job_id, req.group_id, req.token)
        except (LockError, NotFound):
            # Was the group deleted under this very hold? Then say so (costs a read only on failure).
            await self.revocations.raise_if_revoked(req.job_id, req.group_id, req.token)
            raise
        if deferred:
            self.metrics.deferred.inc()
        return pb.YieldReply(released=released, deferred_snapshot=deferred)

    @unary
    async def RegisterWorker(self, req, context):
        lease = await self.sessions.verify(req.job_id, req.session_secret)
        await self.workers.register(req.job_id, lease, req.node, req.pid, req.device_bytes, req.swap,
                                      req.gpus, req.endpoint, req.tags, req.collective)
        return pb.WorkerReply()

    @unary
    async def UnregisterWorker(self, req, context):
        await self.sessions.verify(req.job_id, req.session_secret)
        await self.workers.unregister(req.job_id, req.node, req.pid)
        return pb.WorkerReply()

    @unary
    async def CreateGroup(self, req, context):
        tenants, admins = check_tenants(req.tenants, "tenants"), check_tenants(req.admins, "admins")
        self.tenancy.check_create(self.callers.of(context), tenants)
        spec = await self.groups.create(req.group_id, [(n.node, list(n.gpus)) for n in req.nodes], req.isolation,
                                          tenants, admins, priorities=(req.priorities, req.max_overtakes,
                                                                       req.max_wait_s * 1000), sharing=req.sharing)
        return pb.Group(group_id=req.group_id, isolation=spec.isolation, tenants=spec.tenants, admins=spec.admins,
                        nodes=[pb.NodeSpec(node=n["node"], gpus=n["gpus"]) for n in spec.nodes],
                        sharing=spec.sharing, **priorities_of(spec))

    @unary
    async def DeleteGroup(self, req, context):
        self.tenancy.check_delete(self.callers.of(context), req.group_id)
        return pb.DeleteGroupReply(deleted=await self.groups.delete(req.group_id, req.force))

    @unary
    async def ListGroups(self, req, context):
        return self.reads.list_groups(context)

    @unary
    async def GetGroupStatus(self, req, context):
        return self.reads.group_status(context, req.group_id)

    @unary
    async def ListJobs(self, req, context):
        return self.reads.jobs(context)

    @rpc
    async def GetProfiles(self, req, context):
        return self.reads.job_profiles(context, req.job_id, req.group_id)

    @stream_rpc
    async def WatchGroup(self, req, context):
        check_ids(req)
        async for st in self.reads.watch(context, req.group_id):
            yield st
