"""Admin and status calls: groups, status, create/delete a group, jobs, profiles, and the live watch.

CreateGroup and DeleteGroup carry the admin credential (auth.py); the others
only read (with a credential, where lockd asks for one). None of them needs the
job's session.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from timeslice import errors as E
from timeslice.advise.profile import ProfileSet
from timeslice.auth import metadata_for
from timeslice.core import ALREADY_APPLIED, ClientCore
from timeslice.model import Group, GroupStatus, JobInfo
from timeslice.proto import lockd_pb2 as pb
from timeslice.retry import Call, CallState, TryAgain
from timeslice.transport import Transport


class Admin:
    """Calls that need no session: reads, and the group changes an admin makes."""

    def __init__(self, core: ClientCore, transport: Transport):
        self.core, self.transport = core, transport

    async def groups(self) -> list[Group]:
        """Every group, with its nodes."""
        r = await self.transport.invoke(Call.LIST_GROUPS, pb.ListGroupsRequest, deadline=self.core.deadline(self.core.config.timeout))
        return [Group.from_pb(g) for g in r.groups]

    async def status(self, group_id: str) -> GroupStatus:
        """The group's holder, grant, waiters in order, and per-node residency."""
        r = await self.transport.invoke(Call.GROUP_STATUS, lambda: pb.GroupRef(group_id=group_id),
                               deadline=self.core.deadline(self.core.config.timeout))
        return GroupStatus.from_pb(r)

    async def create_group(self, group_id: str, nodes=None, *, isolation: str = "", tenants=(),
                           admins=(), priorities: bool = False, max_overtakes: int = 0,
                           max_wait_s: int = 0, sharing: str = "") -> Group:
        """Create ``group_id`` over ``nodes`` ("node", "node:0,1", (node, [gpus]) or NodeSpec).
        ``isolation``: the group's policy for parked cooperative workers (lockd lists the
        values it knows; "" is the default). ``tenants``: whose jobs may acquire it ("*": every
        tenant; needed where lockd runs with tenants); ``admins``: the tenants that administer it.
        ``priorities``: Acquire may name a class (0..9; else pure FIFO); a waiter goes first once
        ``max_overtakes`` grants were made since it joined (0: lockd's default) or it waited
        ``max_wait_s`` (0: no time bound). ``sharing``: "" or "exclusive" (one holder at a time, the
        default), or "fit": jobs whose declared footprints fit on the GPUs side by side hold the group
        together; what does not fit is time-sliced. Re-creating it with the same settings is a no-op."""
        req = self.core.create_req(group_id, nodes, isolation, tenants, admins)
        if max_overtakes < 0 or max_wait_s < 0:
            raise E.InvalidArgumentError("max_overtakes and max_wait_s must be >= 0")
        req.priorities, req.max_overtakes, req.max_wait_s = priorities, max_overtakes, max_wait_s
        req.sharing = sharing
        r = await self.transport.invoke(Call.CREATE_GROUP, lambda: req, deadline=self.core.deadline(self.core.config.timeout))
        return Group.from_pb(r)

    async def delete_group(self, group_id: str, force: bool = False) -> bool:
        """Delete ``group_id``; refused while jobs are queued unless ``force`` (their holds end,
        and each is told: see ``on_grant_revoked``)."""
        r = await self.transport.invoke(Call.DELETE_GROUP, lambda: pb.DeleteGroupRequest(group_id=group_id, force=force),
                               deadline=self.core.deadline(self.core.config.timeout))
        return True if r is ALREADY_APPLIED else r.deleted

    async def jobs(self) -> list[JobInfo]:
        """Jobs with a live session."""
        r = await self.transport.invoke(Call.LIST_JOBS, pb.ListJobsRequest, deadline=self.core.deadline(self.core.config.timeout))
        return [JobInfo.from_pb(j) for j in r.jobs]

    async def profiles(self, job_id: str = "", group_id: str = "") -> ProfileSet:
        """The jobs' phase profiles per group as lockd records them (empty ids: all), with the
        groups and the nodes' capacities: what ``timeslice advise`` plans with."""
        r = await self.transport.invoke(Call.GET_PROFILES, lambda: pb.ProfilesRequest(job_id=job_id, group_id=group_id),
                               deadline=self.core.deadline(self.core.config.timeout))
        return ProfileSet.from_pb(r)

    async def watch(self, group_id: str, *, timeout: float | None = None) -> AsyncGenerator[GroupStatus, None]:
        """Iterate over the group's status now and after every change, until the caller stops
        (or ``timeout`` seconds pass). Replicas that fail are left for the next one; the
        stream restarts there with a full picture, and unchanged pictures are not repeated."""
        deadline = self.core.deadline(timeout)
        last: GroupStatus | None = None
        while True:
            holder: dict[str, Any] = {}

            async def open_stream(stub, idx, req, t, holder=holder):
                call = stub.WatchGroup(req, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                                       metadata=metadata_for("WatchGroup"))
                holder.update(call=call, idx=idx)
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise TryAgain("UNAVAILABLE", "watch stream ended")
                return first

            try:
                first = await self.transport.invoke(Call.WATCH_GROUP, lambda: pb.GroupRef(group_id=group_id),
                                           deadline=deadline, cap=0, attempt=open_stream)
            except E.DeadlineError:
                return
            call, idx = holder["call"], holder["idx"]
            try:
                msg = first
                while msg is not grpc.aio.EOF:
                    status = GroupStatus.from_pb(msg)
                    if status != last:
                        last = status
                        yield status
                    msg = await call.read()
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                if code in ("DEADLINE_EXCEEDED", "CANCELLED"):
                    return
                try:
                    self.core.react(CallState(Call.WATCH_GROUP), idx, code, e.details() or "")
                except TryAgain:
                    continue
            finally:
                call.cancel()
