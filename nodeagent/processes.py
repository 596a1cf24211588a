"""Which processes here are a job's, for the agent to act on: read fresh, trusted, never protected.

A job's pids on this node are its registrations (read fresh from etcd on the op path: the
jobs mirror may lag a worker registered a moment ago), the pids adopted for it by a direct
call, and its cooperative workers (theirs as long as they live, registered or not: their
memory moves only through them). From those the agent drops init, itself and the system's
servers (``nodeagent.protected``) and the pids the job has not attested
(``nodeagent.attestations``; each refusal is said once per pid). ``remembered`` are the pids of
the job's last status that are no longer registered (``nodeagent.jobs``).

Right after the agent starts, a pid registered *before* it started that nobody has attested to
it yet may be a worker that has not come back on the channel (its previous agent's word expired
with that agent's lease): such a pid is *settling* for the reconnect grace
(``--reconnect-grace-s``) since the channel opened. (A registration made since then came after
its process attested to this agent: the client attests first.) The agent does not act on it;
its job's picture counts it as unknown (on the device as the meter sees it, never absent), and
an op waits for it to attest or exit first.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog

from timeslice.common import procfs
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
                 swappers: SwapRoutes, require_attestation: bool, settle_s: float = 0.0):
        """``settle_s``: how long after the channel opens an unattested registered pid is waited for
        (the reconnect grace) rather than refused."""
        self.client, self.keys, self.node = client, keys, node
        self.jobs, self.channel, self.swappers = jobs, channel, swappers
        self.require_attestation, self.settle_s = require_attestation, settle_s
        self._unattested: dict[int, str] = {}                         # pid -> job, warned once
        self._inherited: set[tuple[str, int]] = set()                 # (job, pid) registered before our start

    def inherit(self, registered: Iterable[tuple[str, int]]) -> None:
        """The (job, pid) registrations this node had when the agent started (may still be settling)."""
        self._inherited = set(registered)

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
        registered = set(self.trusted(job, await self.candidates(job, regs)))
        return sorted(registered), sorted(self.jobs.remembered(job) - registered)

    async def candidates(self, job: str, regs: list[R.WorkerValue] | None = None) -> list[int]:
        """``job``'s pids here before the attestation check: registered, adopted, its cooperative
        workers; never a protected one."""
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
        return sorted(registered)

    def settling(self, job: str, pids: Iterable[int]) -> list[int]:
        """The ``pids`` of ``job`` that nobody has attested to this agent yet but may still: registered
        before the agent started less than ``settle_s`` ago, and alive (see the module doc)."""
        if not self._inherited or not self.require_attestation or \
                time.monotonic() >= self.channel.started_at + self.settle_s:
            return []
        return sorted(p for p in pids if (job, p) in self._inherited
                      and attestations.owner(p, self.channel.job_of) is None and procfs.is_alive(p))

    def cooperative(self, pids) -> list[int]:
        """Those of ``pids`` whose memory the process itself moves, over its channel."""
        return [p for p in pids if self.swappers.cooperative(p)]

    def trusted(self, job: str, pids: Iterable[int]) -> list[int]:
        """The registered ``pids`` the agent may act on for ``job`` (see nodeagent/attestations.py)."""
        pids = list(pids)
        keep, refused = attestations.trusted(job, pids, self.channel.job_of, self.require_attestation)
        waiting = set(self.settling(job, refused))
        for pid, why in refused.items():
            if pid not in waiting and self._unattested.get(pid) != job:
                self._unattested[pid] = job
                log.warning("worker_not_attested", job=job, pid=pid, why=why)
        return keep
