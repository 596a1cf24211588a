"""The gRPC servicer: proto in, service call, proto out. No logic lives here.

Every error the services raise is a TimesliceError carrying the name of its
gRPC status; ``_rpc`` maps it in one place, so a client always gets a precise
status and a message that says what to do.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from timeslice.common.errors import LockError, TimesliceError
from timeslice.common.server.auth import Authority
from timeslice.common.server.serving import rpc, stream_rpc
from timeslice.lockd import traces
from timeslice.lockd.callers import Callers, peer_identity
from timeslice.lockd.errors import NotFound
from timeslice.lockd.groups import priorities_of
from timeslice.lockd.replica import Replica
from timeslice.lockd.requests import check_ids, ids_checked
from timeslice.lockd.tenancy import check_tenants
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

log = structlog.get_logger(__name__)
_MARGIN = 0.05   # seconds kept back from the caller's deadline to remove our waiter in time


class LockdServicer(pbg.LockdServicer):
    def __init__(self, replica: Replica, callers: Callers | None = None):
        self.r = replica
        self.callers = callers or Callers(Authority(None), replica.config.callers)

    @rpc
    @ids_checked
    async def OpenSession(self, req, context):
        tenant = self.r.tenancy.session_tenant(self.callers.of(context))
        secret, lease, ttl = await self.r.sessions.open(req.job_id, req.ttl_seconds, peer_identity(context), tenant)
        return pb.OpenSessionReply(job_id=req.job_id, session_secret=secret, lease_id=lease, ttl_seconds=ttl)

    @rpc
    @ids_checked
    async def CloseSession(self, req, context):
        return pb.CloseSessionReply(closed=await self.r.sessions.close(req.job_id, req.session_secret, req.lost))

    @rpc
    @ids_checked
    async def KeepAlive(self, req, context):
        ttl = await self.r.sessions.keepalive(req.job_id, req.session_secret)
        # A holder learns here, within a keepalive period, that its group was deleted under it.
        revoked = await self.r.groups.revocations.pending(req.job_id)
        return pb.KeepAliveReply(ttl_seconds=ttl, revoked_groups=revoked)

    @rpc
    @ids_checked
    async def Acquire(self, req, context):
        t0 = time.monotonic()
        lease = await self.r.sessions.verify(req.job_id, req.session_secret)
        await self.r.tenancy.check_acquire(req.job_id, req.group_id)      # before anything is written
        remaining = context.time_remaining()
        timeout = None if remaining is None else max(0.0, remaining - _MARGIN - (time.monotonic() - t0))
        try:
            with traces.acquire_span(context, req, self.r.config.replica_id) as span:   # no-op unless tracing
                got = await self.r.locks.acquire(req.job_id, lease, req.group_id, req.device_bytes_hint, timeout,
                                                 seq=req.attempt_seq, last_hold_ms=req.last_hold_ms,
                                                 priority=req.priority, peak_bytes=req.peak_bytes,
                                                 context_bytes=req.context_bytes, exclusive=req.exclusive)
                traces.granted(span, got)
        except TimesliceError as e:
            self.r.metrics.acquires.labels(type(e).__name__).inc()
            raise
        except asyncio.CancelledError:
            self.r.metrics.acquires.labels("cancelled").inc()
            raise
        self.r.metrics.acquires.labels("granted").inc()
        self.r.metrics.acquire_wait.observe(got.waited_ms / 1000)
        g = got.grant
        return pb.AcquireReply(group_id=req.group_id, job_id=req.job_id, token=got.token,
                               leader_epoch=g.leader_epoch, waited_ms=got.waited_ms, restored=g.restored,
                               elided=g.elided, bytes_moved=g.bytes_moved, footprint_bytes=g.footprint,
                               exclusive=g.exclusive, backfilled=g.backfilled)

    @rpc
    @ids_checked
    async def Yield(self, req, context):
        await self.r.sessions.verify(req.job_id, req.session_secret)
        try:
            released, deferred = await self.r.locks.yield_(req.job_id, req.group_id, req.token)
        except (LockError, NotFound):
            # Was the group deleted under this very hold? Then say so (costs a read only on failure).
            await self.r.groups.revocations.raise_if_revoked(req.job_id, req.group_id, req.token)
            raise
        if deferred:
            self.r.metrics.deferred.inc()
        return pb.YieldReply(released=released, deferred_snapshot=deferred)

    @rpc
    @ids_checked
    async def RegisterWorker(self, req, context):
        lease = await self.r.sessions.verify(req.job_id, req.session_secret)
        await self.r.workers.register(req.job_id, lease, req.node, req.pid, req.device_bytes, req.swap,
                                      req.gpus, req.endpoint, req.tags, req.collective)
        return pb.WorkerReply()

    @rpc
    @ids_checked
    async def UnregisterWorker(self, req, context):
        await self.r.sessions.verify(req.job_id, req.session_secret)
        await self.r.workers.unregister(req.job_id, req.node, req.pid)
        return pb.WorkerReply()

    @rpc
    @ids_checked
    async def CreateGroup(self, req, context):
        tenants, admins = check_tenants(req.tenants, "tenants"), check_tenants(req.admins, "admins")
        self.r.tenancy.check_create(self.callers.of(context), tenants)
        spec = await self.r.groups.create(req.group_id, [(n.node, list(n.gpus)) for n in req.nodes], req.isolation,
                                          tenants, admins, priorities=(req.priorities, req.max_overtakes,
                                                                       req.max_wait_s * 1000), sharing=req.sharing)
        return pb.Group(group_id=req.group_id, isolation=spec.isolation, tenants=spec.tenants, admins=spec.admins,
                        nodes=[pb.NodeSpec(node=n["node"], gpus=n["gpus"]) for n in spec.nodes],
                        sharing=spec.sharing, **priorities_of(spec))

    @rpc
    @ids_checked
    async def DeleteGroup(self, req, context):
        self.r.tenancy.check_delete(self.callers.of(context), req.group_id)
        return pb.DeleteGroupReply(deleted=await self.r.groups.delete(req.group_id, req.force))

    @rpc
    @ids_checked
    async def ListGroups(self, req, context):
        caller = self.callers.reader(context)
        return pb.ListGroupsReply(groups=self.r.tenancy.groups(caller, self.r.groups.list()))

    @rpc
    @ids_checked
    async def GetGroupStatus(self, req, context):
        caller = self.callers.reader(context)
        return self.r.tenancy.status(caller, self.r.groups.status(req.group_id, self.r.epoch, self.r.reflector.revision))

    @rpc
    @ids_checked
    async def ListJobs(self, req, context):
        caller = self.callers.reader(context)
        return pb.ListJobsReply(jobs=self.r.tenancy.jobs(caller, self.r.workers.job_list()))

    @rpc
    async def GetProfiles(self, req, context):
        caller = self.callers.reader(context)
        return self.r.tenancy.profiles(caller, self.r.profile_view.get(req.job_id, req.group_id))

    @stream_rpc
    async def WatchGroup(self, req, context):
        check_ids(req)
        caller = self.callers.reader(context)
        release = self.r.watches.admit(caller.identity)      # RESOURCE_EXHAUSTED past a limit
        try:
            async for st in self._watch(req, caller):
                yield st
        finally:
            release()

    async def _watch(self, req, caller):
        changed = asyncio.Event()
        prefix, nodes = self.r.keys.group(req.group_id), self.r.keys.nodes()

        def on_batch(events, reset):
            # The group's own keys, and any node's (an agent's report or a status changes what it shows).
            if reset or any(ev.kv.key.startswith((prefix, nodes)) for ev in events):
                changed.set()

        self.r.reflector.add_listener(on_batch)
        try:
            last = None
            while True:
                changed.clear()
                st = self.r.tenancy.status(caller, self.r.groups.status(req.group_id, self.r.epoch,
                                                                        self.r.reflector.revision))
                st.revision = 0                 # compare content, not the revision it was read at
                body = st.SerializeToString()
                st.revision = self.r.reflector.revision
                if body != last:
                    last = body
                    yield st
                await changed.wait()
                await asyncio.sleep(0.02)      # coalesce bursts into one update
        finally:
            self.r.reflector.remove_listener(on_batch)
