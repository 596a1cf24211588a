"""Tenants and groups: who may acquire, administer and see what (on with ``--tenants-file``).

A credential names a tenant (``lockd/callers.py``); a job's session records the tenant
its opener presented; a group names the tenants that may acquire it (``tenants``,
``*`` for all) and those that administer it (``admins``). The admin token is the
superuser. The rules, with tenancy on:

* OpenSession needs a tenant's credential (or the admin's): UNAUTHENTICATED;
* Acquire of a group the job's tenant is not listed in: PERMISSION_DENIED, nothing
  written (so no tenant can queue at, or evict the residents of, another's GPUs);
* CreateGroup is the admin's, and names at least one tenant; DeleteGroup is the
  admin's or a tenant's that administers the group;
* a tenant sees the groups it may acquire or administers (others are "unknown"), and
  in them only its own jobs' names (another tenant's are ``REDACTED``; a group's
  administrators see them all); ListJobs shows a tenant its own jobs.

Tenancy off (the local cluster's default), groups' lists are stored but not enforced
and everyone sees everything. Sans-IO except ``job_tenant``'s fallback read.
"""
from __future__ import annotations

from timeslice.common.errors import InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.lockd.callers import ALL_TENANTS, Caller
from timeslice.lockd.errors import Forbidden, NotFound, Unauthenticated
from timeslice.lockd.index import StateIndex
from timeslice.proto import lockd_pb2 as pb

REDACTED = "(another tenant)"
MAX_TENANTS = 64             # tenants (or admins) one group names


def check_tenants(names, what: str) -> list[str]:
    """A group's tenant list, validated (id grammar, or ``*``), deduplicated, in order."""
    out: list[str] = []
    names = list(names)
    if len(names) > MAX_TENANTS:
        raise InvalidIdError(f"limit max_tenants: a group names at most {MAX_TENANTS} {what}")
    for n in names:
        if n != ALL_TENANTS:
            check_id("tenant", n)
        if n not in out:
            out.append(n)
    return out


class Tenancy:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, enabled: bool):
        self.client, self.keys, self.index, self.enabled = client, keys, index, enabled

    # -- sessions and groups ------------------------------------------------------------------
    def session_tenant(self, caller: Caller) -> str:
        """The tenant a session opened by ``caller`` belongs to: its credential's; ``*`` (every tenant's
        groups) for the admin's; "" for none (tenancy off)."""
        if caller.admin:
            return ALL_TENANTS
        if self.enabled and caller.tenant is None:
            raise Unauthenticated("with tenants, OpenSession needs a tenant's credential ('authorization: Bearer "
                                  "<token>' or a client certificate the tenants file names)")
        return caller.tenant or ""

    def check_create(self, caller: Caller, tenants: list[str]) -> None:
        if self.enabled and not tenants:
            raise InvalidIdError("with tenants, a group names the tenants that may acquire it (tenants; '*' for "
                                 "every tenant)")

    def _spec(self, group: str) -> R.GroupSpec | None:
        gs = self.index.groups.get(group)
        return R.GroupSpec.load(gs.spec.value) if gs is not None and gs.spec is not None else None

    @staticmethod
    def _may_acquire(tenant: str, spec: R.GroupSpec) -> bool:
        """A session's tenant ("" for none, ``*`` for the admin's) may acquire the group."""
        return tenant == ALL_TENANTS or ALL_TENANTS in spec.tenants or (tenant != "" and tenant in spec.tenants)

    def _administers(self, caller: Caller, spec: R.GroupSpec) -> bool:
        return caller.admin or (caller.tenant is not None and caller.tenant in spec.admins)

    def _sees(self, caller: Caller, spec: R.GroupSpec) -> bool:
        return (not self.enabled or self._administers(caller, spec)
                or (caller.tenant is not None and self._may_acquire(caller.tenant, spec)))

    async def job_tenant(self, job: str) -> str:
        """The tenant of ``job``'s session ("" if none), from the mirror, else read from etcd."""
        js = self.index.jobs.get(job)
        kv = js.session if js is not None else None
        if kv is None:
            # The mirror may lag a session opened a moment ago on another replica.
            r = await self.client.range(ops.range_req(self.keys.session(job)))
            kv = r.kvs[0] if r.kvs else None
        return R.SessionValue.load(kv.value).tenant if kv is not None else ""

    async def check_acquire(self, job: str, group: str) -> None:
        """PERMISSION_DENIED if ``job``'s tenant may not acquire ``group`` (checked before anything is written)."""
        if not self.enabled:
            return
        spec = self._spec(group)
        if spec is None:
            return                                   # unknown group: Acquire says NOT_FOUND itself
        tenant = await self.job_tenant(job)
        if not self._may_acquire(tenant, spec):
            raise Forbidden(f"tenant {tenant or '(none)'!r} may not acquire group {group!r}: the group names the "
                            "tenants that may; ask its administrator")

    def check_delete(self, caller: Caller, group: str) -> None:
        if not self.enabled or caller.admin:
            return
        if caller.tenant is None:
            raise Unauthenticated("admin call without credentials: send the admin token or the token of a tenant "
                                  "that administers the group ('authorization: Bearer <token>')")
        spec = self._spec(group)
        if spec is None or not self._sees(caller, spec):
            raise NotFound(f"unknown group {group!r}")
        if not self._administers(caller, spec):
            raise Forbidden(f"deleting group {group!r} needs the admin token or a tenant that administers it")

    # -- what a caller sees -------------------------------------------------------------------
    def groups(self, caller: Caller, groups: list[pb.Group]) -> list[pb.Group]:
        if not self.enabled or caller.admin:
            return groups
        return [g for g in groups if (spec := self._spec(g.group_id)) is not None and self._sees(caller, spec)]

    def status(self, caller: Caller, st: pb.GroupStatus) -> pb.GroupStatus:
        """``st`` as ``caller`` may see it: NotFound for a group it may not see, others' job ids redacted."""
        if not self.enabled or caller.admin:
            return st
        spec = self._spec(st.group_id)
        if spec is None or not self._sees(caller, spec):
            raise NotFound(f"unknown group {st.group_id!r}")
        if self._administers(caller, spec):
            return st
        mine = self._jobs_of(caller.tenant)

        def show(job: str) -> str:
            return job if job in mine or job == "" else REDACTED
        st.holder.job_id = show(st.holder.job_id)
        st.grant.job_id = show(st.grant.job_id)
        for h in st.holders:                 # a fit group's every holder
            h.job_id = show(h.job_id)
        for w in st.waiters:
            w.job_id = show(w.job_id)
        for ns in st.node_status:
            resident = [show(j) for j in ns.resident_jobs]
            del ns.resident_jobs[:]
            ns.resident_jobs.extend(resident)
            for js in ns.jobs:
                if js.job_id not in mine:
                    js.job_id, js.error = REDACTED, ""
        return st

    def jobs(self, caller: Caller, jobs: list[pb.JobInfo]) -> list[pb.JobInfo]:
        if not self.enabled or caller.admin:
            return jobs
        mine = self._jobs_of(caller.tenant)
        return [j for j in jobs if j.job_id in mine]

    def profiles(self, caller: Caller, reply: pb.ProfilesReply) -> pb.ProfilesReply:
        """A tenant sees the profiles of its own jobs, and of every job in groups it administers."""
        if not self.enabled or caller.admin:
            return reply
        mine = self._jobs_of(caller.tenant)
        specs = {g.group_id: self._spec(g.group_id) for g in reply.groups}
        out = pb.ProfilesReply(nodes=reply.nodes, groups=self.groups(caller, list(reply.groups)))
        for p in reply.profiles:
            spec = specs.get(p.group_id) or self._spec(p.group_id)
            if p.job_id in mine or (spec is not None and self._administers(caller, spec)):
                out.profiles.append(p)
        return out

    def _jobs_of(self, tenant: str | None) -> set[str]:
        if tenant is None:
            return set()
        out = set()
        for job, js in self.index.jobs.items():
            if js.session is not None and R.SessionValue.load(js.session.value).tenant == tenant:
                out.add(job)
        return out
