"""Job sessions: one etcd lease per job, proven by an unguessable secret.

OpenSession grants the lease and stores only the SHA-256 of a fresh secret
under jobs/<job>/session (attached to that lease). Every later call of the job
presents the secret; without it nobody can yield, extend or register workers
for the job, even knowing its id and token.

Live sessions are bounded (each holds an etcd lease and a key): at most
``--max-sessions`` in the system and ``--max-sessions-per-peer`` opened by one
caller (``lockd.peers``: its TLS identity, else its address). OpenSession past
either returns RESOURCE_EXHAUSTED naming the limit, and changes nothing.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from timeslice.common import records as R
from timeslice.common.errors import ConfigError, EtcdError, InvalidIdError, OutcomeUnknown, SessionLost
from timeslice.common.etcd import ops
from timeslice.common.etcd.client import EtcdClient
from timeslice.common.ids import check_id
from timeslice.common.keys import Keys
from timeslice.common.serving import bounded
from timeslice.lockd.errors import AlreadyExists, BadSecret, LimitExceeded
from timeslice.lockd.index import StateIndex

CLOSED_MARKER_TTL_S = 60            # how long CloseSession's marker outlives the session (see close)


MAX_SESSIONS = 10_000              # live sessions in the system (each is an etcd lease and a key)
MAX_SESSIONS_PER_PEER = 2_048      # live sessions opened by one caller (lockd.peers), e.g. one pod


@dataclass(frozen=True)
class SessionLimits:
    default_ttl: int = 10
    min_ttl: int = 3
    max_ttl: int = 300
    max_sessions: int = MAX_SESSIONS
    max_per_peer: int = MAX_SESSIONS_PER_PEER

    def __post_init__(self) -> None:
        if not 2 <= self.min_ttl <= self.default_ttl <= self.max_ttl:
            raise ConfigError("session ttls must satisfy 2 <= min <= default <= max")
        if self.max_sessions < 1:
            raise ConfigError(f"--max-sessions must be >= 1, got {self.max_sessions}")
        if not 1 <= self.max_per_peer <= self.max_sessions:
            raise ConfigError(f"--max-sessions-per-peer must be in 1..--max-sessions ({self.max_sessions}), "
                              f"got {self.max_per_peer}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Sessions:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, replica: str,
                 limits: SessionLimits = SessionLimits(),
                 seen: Callable[[int], Awaitable[None]] | None = None):
        self.client, self.keys, self.index = client, keys, index
        self.replica = replica
        self.limits = limits
        self._seen = seen                          # waits until this replica's mirror has a revision
        self._opening: dict[str, int] = {}         # peer -> opens on this replica the mirror does not count yet

    async def open(self, job: str, ttl: int, peer: str = "") -> tuple[str, int, int]:
        """Returns (secret, lease_id, ttl). ``peer``: the caller (lockd.peers), for the per-peer limit."""
        check_id("job", job)
        ttl = ttl or self.limits.default_ttl
        if not self.limits.min_ttl <= ttl <= self.limits.max_ttl:
            raise InvalidIdError(
                f"ttl_seconds {ttl} outside [{self.limits.min_ttl}, {self.limits.max_ttl}]")
        self._admit(peer)
        self._opening[peer] = self._opening.get(peer, 0) + 1
        try:
            return await self._open(job, ttl, peer)
        finally:
            left = self._opening[peer] - 1
            if left:
                self._opening[peer] = left
            else:
                del self._opening[peer]

    def _admit(self, peer: str) -> None:
        """Refuse a session past the limits (RESOURCE_EXHAUSTED, naming the limit). Counted on the
        mirror, which every replica shares, plus this replica's opens not mirrored yet; opens racing
        on different replicas may overshoot by at most one each."""
        lim = self.limits
        total = self.index.sessions + sum(self._opening.values())
        if total >= lim.max_sessions:
            raise LimitExceeded(f"limit max_sessions: {total} live sessions, at most {lim.max_sessions}; "
                                "close sessions (or let them expire) first")
        mine = self.index.sessions_by_peer.get(peer, 0) + self._opening.get(peer, 0)
        if mine >= lim.max_per_peer:
            raise LimitExceeded(f"limit max_sessions_per_peer: {bounded(peer or 'this caller', 96)} has {mine} "
                                f"live sessions, at most {lim.max_per_peer}; close some first")

    async def _open(self, job: str, ttl: int, peer: str) -> tuple[str, int, int]:
        lease, granted = await self.client.grant_lease(ttl)
        secret = secrets.token_urlsafe(32)
        value = R.SessionValue(lease, _digest(secret), R.now_ms(), self.replica, peer).dump()
        key = self.keys.session(job)
        # Create-if-absent: two processes claiming one job id must not share it.
        try:
            resp = await self.client.txn([ops.create_rev(key, "==", 0)], [ops.put(key, value, lease)],
                                         [ops.get(key)])
        except OutcomeUnknown:
            # Resolved by reading, never by writing again: the session is ours if its key names our lease.
            r = await self.client.range(ops.range_req(key))
            if r.kvs and R.SessionValue.load(r.kvs[0].value).lease == lease:
                await self._mirrored(r.header.revision)
                return secret, lease, granted
            await self._drop(lease)        # a late-landing write then goes with the lease
            raise
        if not resp.succeeded:
            await self._drop(lease)
            old = R.SessionValue.load(resp.responses[0].response_range.kvs[0].value)
            raise AlreadyExists(
                f"job {job!r} already has a live session (lease {old.lease:x}); close it, or wait "
                f"for it to expire, or use another job id")
        await self._mirrored(resp.header.revision)     # until then it counts as ours in flight (_opening)
        return secret, lease, granted

    async def _drop(self, lease: int) -> None:
        """Give back a lease no session came of (best effort: unrevoked, it expires within its TTL)."""
        try:
            await self.client.revoke(lease)
        except EtcdError:
            pass

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
        # The session key goes in the same transaction, so its revision tells when this replica's
        # mirror (which counts live sessions for the limits) no longer counts it.
        marker, _ttl = await self.client.grant_lease(CLOSED_MARKER_TTL_S)
        resp = await self.client.txn([], [ops.put(self.keys.closed(job), str(R.now_ms()).encode(), marker),
                                          ops.delete(self.keys.session(job))])
        await self.client.revoke(lease)
        await self._mirrored(resp.header.revision)
        return True

    async def _mirrored(self, revision: int) -> None:
        """Wait (bounded by ``seen``) until this replica's mirror, which counts live sessions for
        the limits, has ``revision``."""
        if self._seen is not None:
            try:
                await self._seen(revision)
            except asyncio.TimeoutError:
                pass
