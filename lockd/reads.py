"""The read RPCs (``common/rpcs.py``'s ``READS``): what a caller may see of groups, jobs and profiles.

Each is read auth first (``lockd/callers.py``: a credential where reads need one), then the
mirror's picture, then tenancy's filter (``lockd/tenancy.py``: a tenant sees its own). Served
from this replica's mirror: any replica answers, none waits for an election. A WatchGroup
stream holds one of the bounded places (``lockd/watches.py``) while it lasts.
"""
from __future__ import annotations

import asyncio

from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.lockd.callers import Caller, Callers
from timeslice.lockd.groups import Groups
from timeslice.lockd.index import StateIndex
from timeslice.lockd.profiles import ProfileService
from timeslice.lockd.tenancy import Tenancy
from timeslice.lockd.watches import Watches
from timeslice.lockd.workers import WorkerRegistry
from timeslice.proto import lockd_pb2 as pb


class Reads:
    def __init__(self, callers: Callers, tenancy: Tenancy, groups: Groups, workers: WorkerRegistry,
                 profiles: ProfileService, index: StateIndex, reflector: Reflector, keys: Keys, watches: Watches):
        self.callers, self.tenancy, self.groups, self.workers = callers, tenancy, groups, workers
        self.profiles, self.index, self.reflector, self.keys, self.watches = profiles, index, reflector, keys, watches

    def list_groups(self, context) -> pb.ListGroupsReply:
        caller = self.callers.reader(context)
        return pb.ListGroupsReply(groups=self.tenancy.groups(caller, self.groups.list()))

    def group_status(self, context, group: str) -> pb.GroupStatus:
        return self._status(self.callers.reader(context), group)

    def _status(self, caller: Caller, group: str) -> pb.GroupStatus:
        return self.tenancy.status(caller, self.groups.status(group, self.index.leader_epoch(),
                                                              self.reflector.revision))

    def jobs(self, context) -> pb.ListJobsReply:
        caller = self.callers.reader(context)
        return pb.ListJobsReply(jobs=self.tenancy.jobs(caller, self.workers.job_list()))

    def job_profiles(self, context, job: str, group: str) -> pb.ProfilesReply:
        caller = self.callers.reader(context)
        return self.tenancy.profiles(caller, self.profiles.get(job, group))

    async def watch(self, context, group: str):
        caller = self.callers.reader(context)
        release = self.watches.admit(caller.identity)      # RESOURCE_EXHAUSTED past a limit
        try:
            async for st in self._watch(caller, group):
                yield st
        finally:
            release()

    async def _watch(self, caller: Caller, group: str):
        changed = asyncio.Event()
        prefix, nodes = self.keys.group(group), self.keys.nodes()

        def on_batch(events, reset):
            # The group's own keys, and any node's (an agent's report or a status changes what it shows).
            if reset or any(ev.kv.key.startswith((prefix, nodes)) for ev in events):
                changed.set()

        self.reflector.add_listener(on_batch)
        try:
            last = None
            while True:
                changed.clear()
                st = self._status(caller, group)
                st.revision = 0                 # compare content, not the revision it was read at
                body = st.SerializeToString()
                st.revision = self.reflector.revision
                if body != last:
                    last = body
                    yield st
                await changed.wait()
                await asyncio.sleep(0.02)      # coalesce bursts into one update
        finally:
            self.reflector.remove_listener(on_batch)
