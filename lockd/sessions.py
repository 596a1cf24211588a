"""Job sessions: one etcd lease per job, proven by an unguessable secret.

OpenSession grants the lease and stores only the SHA-256 of a fresh secret
under jobs/<job>/session (attached to that lease). Every later call of the job
presents the secret; without it nobody can yield, extend or register workers
for the job, even knowing its id and token.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from timeslice.lockd.errors import AlreadyExists, BadSecret
from timeslice.lockd.index import StateIndex
from timeslice.common import records as R
from timeslice.common.errors import ConfigError, InvalidIdError, SessionLost
from timeslice.common.etcd import ops
from timeslice.common.etcd.client import EtcdClient
from timeslice.common.ids import check_id
from timeslice.common.keys import Keys


CLOSED_MARKER_TTL_S = 60            # how long CloseSession's marker outlives the session (see close)


@dataclass(frozen=True)
class SessionLimits:
    default_ttl: int = 10
    min_ttl: int = 3
    max_ttl: int = 300

    def __post_init__(self) -> None:
        if not 2 <= self.min_ttl <= self.default_ttl <= self.max_ttl:
            raise ConfigError("session ttls must satisfy 2 <= min <= default <= max")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Sessions:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, replica: str,
                 limits: SessionLimits = SessionLimits()):
        self.client, self.keys, self.index = client, keys, index
        self.replica = replica
        self.limits = limits

    async def open(self, job: str, ttl: int) -> tuple[str, int, int]:
        """Returns (secret, lease_id, ttl)."""
        check_id("job", job)
        ttl = ttl or self.limits.default_ttl
        if not self.limits.min_ttl <= ttl <= self.limits.max_ttl:
            raise InvalidIdError(
                f"ttl_seconds {ttl} outside [{self.limits.min_ttl}, {self.limits.max_ttl}]")
        lease, granted = await self.client.grant_lease(ttl)
        secret = secrets.token_urlsafe(32)
        value = R.SessionValue(lease, _digest(secret), R.now_ms(), self.replica).dump()
        key = self.keys.session(job)
        # Create-if-absent: two processes claiming one job id must not share it.
        resp = await self.client.txn([ops.create_rev(key, "==", 0)], [ops.put(key, value, lease)], [ops.get(key)])
        if not resp.succeeded:
            await self.client.revoke(lease)
            old = R.SessionValue.load(resp.responses[0].response_range.kvs[0].value)
            raise AlreadyExists(
                f"job {job!r} already has a live session (lease {old.lease:x}); close it, or wait "
                f"for it to expire, or use another job id")
        return secret, lease, granted

    async def verify(self, job: str, secret: str) -> int:
        """The job's lease id if ``secret`` opens its session; raises otherwise."""
        check_id("job", job)
        js = self.index.jobs.get(job)
        kv = js.session if js else None
        if kv is None:
            # The mirror may lag a session opened a moment ago on another replica.
            r = await self.client.range(ops.range_req(self.keys.session(job)))
            kv = r.kvs[0] if r.kvs else None
        if kv is None:
            raise SessionLost(f"job {job!r} has no live session (expired or never opened); open one")
        val = R.SessionValue.load(kv.value)
        if not secret or not hmac.compare_digest(val.secret_sha256, _digest(secret)):
            raise BadSecret(f"session secret does not match job {job!r}")
        return val.lease

    async def keepalive(self, job: str, secret: str) -> int:
        lease = await self.verify(job, secret)
        ttl = await self.client.keepalive_once(lease)
        if ttl <= 0:
            raise SessionLost(f"session of job {job!r} expired; open a new one")
        return ttl

    async def close(self, job: str, secret: str) -> bool:
        try:
            lease = await self.verify(job, secret)
        except SessionLost:
            return False
        # A marker first, on a short lease of its own: the node agents then know the job's workers
        # go deliberately and do not freeze its processes (nodeagent/orphans.py freezes only those of
        # a session that *expired*, a holder paused past its lease). A plain put: a retry is harmless.
        marker, _ttl = await self.client.grant_lease(CLOSED_MARKER_TTL_S)
        await self.client.txn([], [ops.put(self.keys.closed(job), str(R.now_ms()).encode(), marker)])
        await self.client.revoke(lease)
        return True
