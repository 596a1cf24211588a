"""A job's process on this node: how it proves it is the job's, which pids the agent acts on, what lockd is told.

**The proof.** RegisterWorker goes through lockd, which cannot see the node's processes: a
job could name any pid there, another job's worker included. The node-local channel
closes that gap. A job's process that opens it is known to the agent by the kernel's word
(``SO_PEERCRED``, the channel's: nodeagent/channel.py) and by the job's session secret
(``WorkerAuth``: lockd keeps only the secret's SHA-256 in the job's session key; a
worker's hello carries the secret itself, and the channel asks ``authorize`` before it
welcomes the worker). The client library opens the channel when it registers a worker
(``Workers.attest_worker`` in ``timeslice.workers``).

**The rule** (``owner``, ``trusted``; sans-IO). A registered pid is the job's when the pid
itself, or one of its ancestors (a launcher that starts its ranks), holds such a
connection for that job; on Kubernetes with a hostPID agent, the pod's processes descend
from the container's, so the rule holds there too. With ``--require-attestation`` (on in
deploy/ and the local launcher) the agent ignores unattested registrations (never
snapshots, restores or counts them) and says so once per pid. Without it (the test
harness default, for tests that register processes they start from outside), attestation
is still checked and a registration that another job attested is ignored: an attested
process is never acted on for a job that is not its own.

**The agent's word to lockd** (``Attestations``). lockd registers workers but cannot see a
node's processes, so a job could register a pid that another job's process attested over
the channel and not yet registered, and then the owner's own registration would be
refused (the pid already "belongs" to the squatter). The agent closes that gap by
publishing what only it knows:

* ``nodes/<node>/attested/<pid>``: the job a process proved it belongs to,
  written *before* the worker is welcomed, so the job's RegisterWorker that
  follows the welcome finds it; deleted when the process is gone;
* ``nodes/<node>/protected``: init, the agent itself, etcd, lockd and other
  agents on the node (``nodeagent/protected.py``), refreshed when it changes.

Both live on the agent's lease: a dead agent's word goes with it. A sync pass
(every refresh interval) rewrites them on a renewed lease and removes the records
of processes the channel forgot. Publishing is best effort: an etcd outage must
not keep a worker from connecting (lockd then falls back to first come, first
served, and the agent still never acts on a pid for a job that did not attest it).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable

import structlog

from timeslice.common import procfs
from timeslice.common.errors import TimesliceError
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.nodeagent import protected
from timeslice.nodeagent.jobs import LocalJobs

log = structlog.get_logger(__name__)

PUBLISH_TIMEOUT_S = 2.0       # a welcome waits at most this long for etcd
MAX_PROTECTED = 256           # protected pids published (a node runs a handful)
MAX_DEPTH = 64           # ancestors looked at; process trees are shallow


def owner(pid: int, job_of: Callable[[int], str | None], proc_root: str | os.PathLike = procfs.PROC_ROOT
          ) -> str | None:
    """The job that attested ``pid`` (itself or its nearest attested ancestor), or None."""
    seen = 0
    cur: int | None = pid
    while cur and cur > 1 and seen < MAX_DEPTH:
        job = job_of(cur)
        if job is not None:
            return job
        cur = procfs.parent_pid(cur, proc_root)
        seen += 1
    return None


def trusted(job: str, pids: Iterable[int], job_of: Callable[[int], str | None], required: bool,
            proc_root: str | os.PathLike = procfs.PROC_ROOT) -> tuple[list[int], dict[int, str]]:
    """(pids to act on for ``job``, {pid: why not} for the others)."""
    keep, refused = [], {}
    for pid in pids:
        who = owner(pid, job_of, proc_root)
        if who == job or (who is None and not required):
            keep.append(pid)
        elif who is None:
            refused[pid] = "not attested: no process of the job opened the node agent's channel for it"
        else:
            refused[pid] = "attested by another job"
    return keep, refused


class WorkerAuth:
    def __init__(self, client: EtcdClient, keys: Keys, jobs: LocalJobs):
        self.client, self.keys, self.jobs = client, keys, jobs

    async def authorize(self, job: str, secret: str) -> str | None:
        """None if ``secret`` is the session secret of ``job`` (lockd keeps only its SHA-256).

        etcd decides, read fresh: the jobs mirror may lag a session opened a moment ago, or one
        opened again under the same job id by a restarted job (a new secret, which the mirror's
        old digest would refuse while it let the old secret in). Only while etcd cannot be read
        does the mirror's last known digest stand in (a worker reconnecting must not be refused
        over an etcd blip). A worker connects once per process start or agent restart.
        """
        try:
            # Linearizable (the client's default): a serializable read could come from a lagging member.
            r = await self.client.range(ops.range_req(self.keys.session(job)))
            raw = r.kvs[0].value if r.kvs else None
            digest = R.SessionValue.load(raw).secret_sha256 if raw is not None else None
        except TimesliceError as e:
            log.warning("session_read_failed", job=job, error=str(e)[:200], fallback="mirror")
            digest = self.jobs.session_digest(job)
        except Exception:
            digest = None                                # a session key that is not a session
        if digest is None:
            return f"job {job!r} has no live session"
        if not hmac.compare_digest(hashlib.sha256(secret.encode()).hexdigest(), digest):
            return f"wrong session secret for job {job!r}"
        return None


class Attestations:
    def __init__(self, client: EtcdClient, keys: Keys, node: str, lease: Callable[[], int],
                 scan: Callable[[], dict[int, str]] = protected.scan):
        self.client, self.keys, self.node, self.lease, self.scan = client, keys, node, lease, scan
        self._written: dict[int, tuple[str, int | None, int]] = {}   # pid -> (job, start_time, lease)
        self._protected: tuple[dict[int, str], int] | None = None     # (pids, lease) last written

    async def publish(self, pid: int, job: str, start_time: int | None) -> None:
        """Say that ``pid`` (this incarnation) attested for ``job``. Never raises."""
        lease = self.lease()
        if self._written.get(pid) == (job, start_time, lease):
            return
        val = R.AttestedValue(job, pid, start_time, R.now_ms())
        try:
            # A plain put on the agent's lease: the record is this agent's word about a process on its
            # node; the last hello of the pid wins (a reused pid's new process says hello anew).
            await self.client.txn([], [ops.put(self.keys.attested(self.node, pid), val.dump(), lease)],
                                  timeout=PUBLISH_TIMEOUT_S)
        except (TimesliceError, asyncio.TimeoutError) as e:
            log.warning("attestation_unpublished", pid=pid, job=job, error=str(e)[:200])
            return
        self._written[pid] = (job, start_time, lease)

    async def withdraw(self, pids: Iterable[int]) -> None:
        """The processes are gone: their records go too."""
        for pid in list(pids):
            if self._written.pop(pid, None) is None:
                continue
            try:
                # Unconditional: a record of a pid this agent saw exit is void whoever wrote it last.
                await self.client.txn([], [ops.delete(self.keys.attested(self.node, pid))])
            except TimesliceError as e:
                log.warning("attestation_withdraw_failed", pid=pid, error=str(e)[:200])

    async def sync(self, attested: dict[int, tuple[str, int | None]]) -> None:
        """Bring etcd in line with what the channel knows now ({pid: (job, start_time)}) and the
        protected processes with what /proc says."""
        await self.withdraw([p for p in self._written if p not in attested])
        for pid, (job, start) in attested.items():
            await self.publish(pid, job, start)
        await self.publish_protected()

    async def publish_protected(self) -> None:
        pids = dict(sorted((await asyncio.to_thread(self.scan)).items())[:MAX_PROTECTED])
        lease = self.lease()
        if self._protected == (pids, lease):
            return
        val = R.ProtectedValue({str(p): why for p, why in pids.items()}, R.now_ms())
        try:
            # One key per node, on the agent's lease: replaced whole whenever the set changes.
            await self.client.txn([], [ops.put(self.keys.protected(self.node), val.dump(), lease)])
        except TimesliceError as e:
            log.warning("protected_unpublished", error=str(e)[:200])
            return
        self._protected = (pids, lease)

    async def loop(self, attested: Callable[[], dict[int, tuple[str, int | None]]], interval: float) -> None:
        """Sync every ``interval`` seconds for the life of the agent."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync(attested())
            except Exception:  # never let the loop die: the next pass tries again
                log.exception("attestations_sync_failed")
