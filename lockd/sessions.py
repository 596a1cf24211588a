"""Job sessions: one etcd lease per job, proven by an unguessable secret.

OpenSession grants the lease and stores only the SHA-256 of a fresh secret
under jobs/<job>/session (attached to that lease). Every later call of the job
presents the secret; without it nobody can yield, extend or register workers
for the job, even knowing its id and token.

Live sessions are bounded (each holds an etcd lease and a key): at most
``--max-sessions`` in the system and ``--max-sessions-per-peer`` opened by one
caller (``lockd.callers``: its TLS identity, else its address). OpenSession past
either returns RESOURCE_EXHAUSTED naming the limit, and changes nothing. Each
session holds one slot of each limit (lockd/slots.py), written in the same
transaction as its key, so the bounds hold across replicas and parallel callers.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from timeslice.common.errors import ConfigError, EtcdError, EtcdUnavailable, InvalidIdError, OutcomeUnknown, SessionLost
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.common.server.serving import bounded
from timeslice.lockd import slots as S
from timeslice.lockd.errors import AlreadyExists, BadSecret, LimitExceeded
from timeslice.lockd.index import StateIndex

log = structlog.get_logger(__name__)

CLOSED_MARKER_TTL_S = 60            # how long CloseSession's marker outlives the session (see close)


MAX_SESSIONS = 10_000              # live sessions in the system (each is an etcd lease and a key)
MAX_SESSIONS_PER_PEER = 2_048      # live sessions opened by one caller (lockd.callers), e.g. one pod


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


@dataclass
class _Room:
    """The slots one OpenSession knows to be taken: of all sessions, and of its caller's."""

    total: set[int]
    mine: set[int]
    fresh: bool = False                # read from etcd (not only the mirror)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class JobSessions:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, replica: str,
                 limits: SessionLimits = SessionLimits(),
                 seen: Callable[[int], Awaitable[None]] | None = None):
        self.client, self.keys, self.index = client, keys, index
        self.replica = replica
        self.limits = limits
        self._seen = seen                          # waits until this replica's mirror has a revision
        self._rng = random.Random()

    async def open(self, job: str, ttl: int, peer: str = "", tenant: str = "") -> tuple[str, int, int]:
        """Returns (secret, lease_id, ttl). ``peer``: the caller (lockd.callers), for the per-peer limit;
        ``tenant``: the tenant the session belongs to (lockd/tenancy.py)."""
        check_id("job", job)
        ttl = ttl or self.limits.default_ttl
        if not self.limits.min_ttl <= ttl <= self.limits.max_ttl:
            raise InvalidIdError(
                f"ttl_seconds {ttl} outside [{self.limits.min_ttl}, {self.limits.max_ttl}]")
        room = _Room(set(self.index.slots_taken(S.SESSIONS)), set(self.index.slots_taken(S.peer_space(peer))))
        await self._admit(peer, room)                  # refused before any lease is granted
        lease, granted = await self.client.grant_lease(ttl)
        try:
            secret = await self._claim(job, lease, peer, room, tenant)
        except BaseException:
            await asyncio.shield(self._drop(lease))      # no session came of it: nothing may be left
            raise
        return secret, lease, granted

    async def _admit(self, peer: str, room: _Room) -> None:
        """Refuse a session past the limits (RESOURCE_EXHAUSTED, naming the limit). ``room``: the slots
        taken as far as we know (the mirror, and what our own tries found taken); before a refusal
        they are read from etcd once, as the mirror may lag a close on another replica."""
        lim = self.limits
        while True:
            full = len(room.total) >= lim.max_sessions or len(room.mine) >= lim.max_per_peer
            if not full:
                return
            if room.fresh:
                break
            room.total = await S.taken_now(self.client, self.keys, S.SESSIONS)
            room.mine = await S.taken_now(self.client, self.keys, S.peer_space(peer))
            room.fresh = True
        if len(room.total) >= lim.max_sessions:
            raise LimitExceeded(f"limit max_sessions: {len(room.total)} live sessions, at most {lim.max_sessions}; "
                                "close sessions (or let them expire) first")
        raise LimitExceeded(f"limit max_sessions_per_peer: {bounded(peer or 'this caller', 96)} has {len(room.mine)} "
                            f"live sessions, at most {lim.max_per_peer}; close some first")

    async def _claim(self, job: str, lease: int, peer: str, room: _Room, tenant: str = "") -> str:
        """Write the session with its two slots (lockd/slots.py); returns its secret."""
        secret = secrets.token_urlsafe(32)
        key, pspace = self.keys.session(job), S.peer_space(peer)
        for _ in range(S.MAX_TRIES):
            await self._admit(peer, room)              # so a free slot exists in both ranges
            g, p = S.pick(room.total, self.limits.max_sessions, self._rng), \
                S.pick(room.mine, self.limits.max_per_peer, self._rng)
            gkey, pkey = self.keys.slot(S.SESSIONS, g), self.keys.slot(pspace, p)
            value = R.SessionValue(lease, _digest(secret), R.now_ms(), self.replica, peer, g, p, tenant).dump()
            owner = R.SlotValue(job).dump()
            # Create-if-absent, all three: two processes claiming one job id must not share it, and
            # a slot another open took first means "pick another", never "two in one place".
            cmp = [ops.create_rev(key, "==", 0), ops.create_rev(gkey, "==", 0), ops.create_rev(pkey, "==", 0)]
            try:
                resp = await self.client.txn(cmp, [ops.put(key, value, lease), ops.put(gkey, owner, lease),
                                                   ops.put(pkey, owner, lease)],
                                             [ops.get(key), ops.get(gkey), ops.get(pkey)])
            except OutcomeUnknown:
                # Resolved by reading, never by writing again: the session is ours if its key names our lease.
                r = await self.client.range(ops.range_req(key))
                if r.kvs and R.SessionValue.load(r.kvs[0].value).lease == lease:
                    await self._mirrored(r.header.revision)
                    return secret
                raise                                   # the caller revokes the lease: a late write goes with it
            if resp.succeeded:
                await self._mirrored(resp.header.revision)
                return secret
            held = resp.responses[0].response_range.kvs
            if held:
                old = R.SessionValue.load(held[0].value)
                raise AlreadyExists(
                    f"job {job!r} already has a live session (lease {old.lease:x}); close it, or wait "
                    f"for it to expire, or use another job id")
            if resp.responses[1].response_range.kvs or resp.responses[2].response_range.kvs:
                # A parallel open took a place first, and the mirror may lag many such opens: read
                # both spaces once, so the next pick is among places free now.
                room.total = await S.taken_now(self.client, self.keys, S.SESSIONS)
                room.mine = await S.taken_now(self.client, self.keys, pspace)
                room.fresh = True
        raise EtcdUnavailable(f"OpenSession of {job!r}: parallel opens kept taking the places it picked; try again")

    async def _drop(self, lease: int) -> None:
        """Give back a lease no session came of (best effort: unrevoked, it expires within its TTL)."""
        try:
            await self.client.revoke(lease)
        except EtcdError:
            pass

    async def verify(self, job: str, secret: str) -> int:
        """The job's lease id if ``secret`` opens its session; raises otherwise."""
        return (await self._session(job, secret))[1].lease

    async def _session(self, job: str, secret: str) -> tuple[bytes, R.SessionValue]:
        """(the session key's raw value, decoded) if ``secret`` opens the job's session."""
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
        return kv.value, val

    async def keepalive(self, job: str, secret: str) -> int:
        lease = await self.verify(job, secret)
        ttl = await self.client.keepalive_once(lease)
        if ttl <= 0:
            raise SessionLost(f"session of job {job!r} expired; open a new one")
        return ttl

    async def close(self, job: str, secret: str, lost: bool = False) -> bool:
        """End the session; False if it had ended already. ``lost``: its client had declared it lost
        (no keepalive for a TTL) and ends it as soon as it reaches lockd again, so the queue entries
        it left go now instead of when the lease runs out (lockd.proto SessionRef.lost)."""
        try:
            raw, val = await self._session(job, secret)
        except SessionLost:
            return False
        if lost:
            # As if the lease had expired, only now: everything it owned goes in one revision, and no
            # marker, so the agents fence what of the job is still on a device as after any expiry.
            revision = await self.client.revoke(val.lease)
            log.info("session_ended", job=job, lease=f"{val.lease:x}", why="its client had declared it lost",
                     ended=revision > 0)
            await self._mirrored(revision)
            return revision > 0
        # A marker first, on a short lease of its own: the node agents then know the job's workers
        # go deliberately and do not freeze its processes (nodeagent/orphans.py freezes only those of
        # a session that *expired*, a holder paused past its lease). A plain put: a retry is harmless.
        # The session key and its slots go in the same transaction, so its revision tells when this
        # replica's mirror (which counts live sessions for the limits) no longer counts it; guarded
        # by the session as verified, so a mirror that lags can never make it end a newer session.
        marker, _ttl = await self.client.grant_lease(CLOSED_MARKER_TTL_S)
        resp = await self.client.txn([ops.value_is(self.keys.session(job), "==", raw)],
                                     [ops.put(self.keys.closed(job), str(R.now_ms()).encode(), marker),
                                      ops.delete(self.keys.session(job)), *self._slot_deletes(val)])
        if not resp.succeeded:
            await self._drop(marker)
            return False                            # it had ended already
        await self.client.revoke(val.lease)
        await self._mirrored(resp.header.revision)
        return True

    def _slot_deletes(self, val: R.SessionValue) -> list:
        """The session's slots go with its key (in one revision: the mirror counts both alike)."""
        out = []
        if val.slot >= 0:
            out.append(ops.delete(self.keys.slot(S.SESSIONS, val.slot)))
        if val.peer_slot >= 0:
            out.append(ops.delete(self.keys.slot(S.peer_space(val.peer), val.peer_slot)))
        return out

    async def _mirrored(self, revision: int) -> None:
        """Wait (bounded by ``seen``) until this replica's mirror, which counts live sessions for
        the limits, has ``revision``."""
        if self._seen is not None:
            try:
                await self._seen(revision)
            except asyncio.TimeoutError:
                pass
