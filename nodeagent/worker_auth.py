"""Who may open the node-local channel for a job: a process that holds the job's session secret.

lockd keeps only the secret's SHA-256 in the job's session key; a worker's hello carries the
secret itself, and the channel (nodeagent/channel.py) asks ``authorize`` before it welcomes
the worker. The kernel's word on the pid (``SO_PEERCRED``) is the channel's; this room says
only whether the secret is the job's.
"""
from __future__ import annotations

import hashlib
import hmac

import structlog

from timeslice.common.errors import TimesliceError
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.nodeagent.jobs import LocalJobs

log = structlog.get_logger(__name__)


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
