"""Which processes here are a job's, for the agent to act on: read fresh, trusted, never protected.

A job's pids on this node are its registrations (read fresh from etcd on the op path: the
jobs mirror may lag a worker registered a moment ago), the pids adopted for it by a direct
call, and its cooperative workers (theirs as long as they live, registered or not: their
memory moves only through them). From those the agent drops init, itself and the system's
servers (``nodeagent.protected``) and the pids the job has not attested
(``nodeagent.attestations``; each refusal is said once per pid). ``remembered`` are the pids of
the job's last status that are no longer registered (``nodeagent.jobs``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.nodeagent import attestations
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.discovery import local_registered_pids
from timeslice.nodeagent.jobs import LocalJobs
from timeslice.nodeagent.protected import protected_reason
from timeslice.nodeagent.swap_routes import SwapRoutes

log = structlog.get_logger(__name__)


class JobProcesses:
    def __init__(self, client: EtcdClient, keys: Keys, node: str, jobs: LocalJobs, channel: ChannelServer,
                 swappers: SwapRoutes, require_attestation: bool):
        self.client, self.keys, self.node = client, keys, node
        self.jobs, self.channel, self.swappers = jobs, channel, swappers
        self.require_attestation = require_attestation
        self._unattested: dict[int, str] = {}                         # pid -> job, warned once

    async def registrations(self, job: str) -> list[R.WorkerValue]:
        """``job``'s worker registrations on this node, read fresh from etcd."""
        prefix = self.keys.node_workers(job, self.node)
        # Linearizable (the client's default): the op acts on what the job registered up to now.
        r = await self.client.range(ops.range_req(prefix, prefix=True))
        read = []
        for kv in r.kvs:
            try:
                read.append((kv, R.WorkerValue.load(kv.value)))
            except Exception:  # a malformed registration names no process
                log.warning("bad_worker_key", key=kv.key.decode(errors="replace"))
        self.swappers.note(job, read)                    # ahead of the jobs mirror, maybe
        return [reg for _, reg in read]

    async def pids(self, job: str, regs: list[R.WorkerValue] | None = None) -> tuple[list[int], list[int]]:
        """(registered, remembered) pids of ``job`` here; registrations read fresh from etcd."""
        entries = [w.__dict__ for w in (regs if regs is not None else await self.registrations(job))]
        registered = set(await asyncio.to_thread(local_registered_pids, entries, self.node))
        registered |= self.jobs.adopted.get(job, set())
        # A cooperative worker is the job's as long as it lives, registered or not (its job closed its
        # session, or the session went while it was parked): its memory moves only through it.
        registered |= {p for p, j in self.channel.cooperative_pids().items() if j == job}
        # A job may register any pid; the agent never acts on init, itself or the system's servers.
        for pid in [p for p in registered if protected_reason(p)]:
            log.warning("protected_pid_registered", job=job, pid=pid, why=protected_reason(pid))
            registered.discard(pid)
        registered = set(self.trusted(job, registered))
        return sorted(registered), sorted(self.jobs.remembered(job) - registered)

    def trusted(self, job: str, pids: Iterable[int]) -> list[int]:
        """The registered ``pids`` the agent may act on for ``job`` (see nodeagent/attestations.py)."""
        keep, refused = attestations.trusted(job, pids, self.channel.job_of, self.require_attestation)
        for pid, why in refused.items():
            if self._unattested.get(pid) != job:
                self._unattested[pid] = job
                log.warning("worker_not_attested", job=job, pid=pid, why=why)
        return keep
