"""Acquire and Yield as any replica serves them (the leader grants; see scheduler.py).

Acquire = one idempotent enqueue transaction, then a wait on this replica's
mirror for one of three outcomes concerning this job only: a grant naming
our token (granted), a failure record with our token (the swap failed), or
our queue entry gone (session lost). A cancelled or timed-out Acquire deletes
its own entry, guarded by its token, so no ghost waiter stays behind.

A re-sent Acquire (client failover, retry) finds the job's entry and takes it
over: it rewrites the value with its own attempt id, which keeps the entry's
create revision (its place and token). An abandoned attempt deletes the entry
only while the value still carries *its* attempt id, so an old call cancelled
late on another replica can never release the hold a newer call returned.
Attempts the client numbered (``attempt_seq``) are ordered by that number, not
by when a replica got round to them (attempts.py): a stale one changes nothing.

In a group with priority classes (priority.py) an Acquire names its class. The
leader moves an overtaken waiter's entry under a fresh key before its turn
(rekey.py); the call follows it (its token is the new key's create revision),
and a cancelled one removes it wherever it is.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from aetcd import rpc

from timeslice.common import tracing
from timeslice.common.errors import (
    EtcdUnavailable,
    GuardFailed,
    InvalidIdError,
    LockError,
    NotHolder,
    OutcomeUnknown,
    SessionLost,
    StaleToken,
)
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.election import Leadership
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.etcd.queue import FifoQueue
from timeslice.common.server.keys import Keys
from timeslice.lockd import handoff as H
from timeslice.lockd import priority as PR
from timeslice.lockd import rekey as RK
from timeslice.lockd.attempts import AttemptFence
from timeslice.lockd.errors import AcquireTimeout, NotFound, Superseded, SwapFailed
from timeslice.lockd.index import StateIndex
from timeslice.lockd.plan import Policy
from timeslice.lockd.waiters import Waiters

MAX_HOLD_MS = 30 * 24 * 3600 * 1000   # a hold the job reports (profiles): a month at most
MAX_MEASURED_BYTES = 1 << 50           # a peak or context a job reports (footprints): a petabyte at most

#: Looks at the group's spec an Acquire makes while the group is deleted and created again under it.
MAX_SPEC_TRIES = 3


@dataclass(frozen=True)
class Granted:
    token: int
    grant: R.GrantValue
    waited_ms: float


class Locks:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, reflector: Reflector,
                 waiters: Waiters, replica: str, policy: Policy = Policy(),
                 leadership: Callable[[], Leadership | None] = lambda: None,
                 on_direct_grant: Callable[[str, R.GrantValue, bool], None] | None = None):
        self.client, self.keys, self.index = client, keys, index
        self.reflector, self.waiters, self.replica = reflector, waiters, replica
        self.policy, self.leadership, self.on_direct_grant = policy, leadership, on_direct_grant
        self.fence = AttemptFence(client, keys, reflector)

    async def _spec_rev(self, group: str, fresh: bool = False) -> int:
        """The create revision of ``group``'s spec: which incarnation of the group a call acts on
        (a group deleted and created again under its name has another). NotFound if there is none."""
        return (await self._spec_of(group, fresh))[0]

    async def _spec_of(self, group: str, fresh: bool = False) -> tuple[int, R.GroupSpec]:
        gs = self.index.groups.get(group)
        if not fresh and gs is not None and gs.spec is not None:
            return gs.spec.create_revision, gs.parsed or R.GroupSpec.load(gs.spec.value)
        # The mirror may lag a group created a moment ago on another replica (``fresh``: or a delete).
        r = await self.client.range(ops.range_req(self.keys.spec(group)))
        if not r.kvs:
            raise NotFound(f"unknown group {group!r}; create it first (timeslice group create)")
        return r.kvs[0].create_revision, R.GroupSpec.load(r.kvs[0].value)

    async def _arrival(self, group: str, job: str, lease: int) -> dict:
        """A movable group's entry fields (priority classes, a fit group): the job's arrival and age
        carried over from its entry (a re-sent Acquire takes it over), else the group's grant count now
        (the aging clock). Read from etcd, not the mirror: a job's next Acquire right after its Yield
        must not find the entry that Yield deleted (the mirror may not show the delete yet) and take its
        old arrival, jumping ahead of everyone who queued meanwhile."""
        # Why: one read at one revision of the entry, its being-moved marker and the turns key (no write).
        r = await self.client.txn([], [ops.get(self.keys.queue_entry(group, job)), ops.get(self.keys.moving(group, job)),
                                       ops.get(self.keys.turns(group))])
        found = [kv for resp in r.responses[:2] for kv in resp.response_range.kvs]
        kv = found[0] if found else None                                   # queued, or out being moved
        if kv is not None and kv.lease == lease:
            old = R.QueueValue.load(kv.value)
            # Its arrival spelt out (not 0 for "this key"): the entry may be moved before we take it over.
            return {"since": old.arrival(kv.create_revision), "since_grants": old.since_grants,
                    "enqueued_ms": old.enqueued_ms}
        turns = r.responses[2].response_range.kvs
        return {"since_grants": R.TurnsValue.load(turns[0].value).grants if turns else 0}

    async def _require_group(self, group: str) -> None:
        await self._spec_rev(group)

    async def acquire(self, job: str, lease: int, group: str, hint: int, timeout: float | None,
                      seq: int = 0, last_hold_ms: int = 0, priority: int = 0, peak_bytes: int = 0,
                      context_bytes: int = 0, exclusive: bool = False) -> Granted:
        """``exclusive``: the phase asks for the group's GPUs alone (a fit group: it weighs the whole device)."""
        t0 = time.monotonic()
        check_id("job", job), check_id("group", group)
        if hint < 0:
            raise InvalidIdError("device_bytes_hint must be >= 0")
        if not 0 <= last_hold_ms <= MAX_HOLD_MS:
            raise InvalidIdError(f"last_hold_ms must be in [0, {MAX_HOLD_MS}]")
        for name, n in (("peak_bytes", peak_bytes), ("context_bytes", context_bytes)):
            if not 0 <= n <= MAX_MEASURED_BYTES:
                raise InvalidIdError(f"{name} must be in [0, {MAX_MEASURED_BYTES}]")
        spec_rev, spec = await self._spec_of(group)
        PR.check_priority(spec, priority, group)           # before anything is written
        attempt = secrets.token_hex(8)
        # trace: the leader's and the agents' spans of this handoff join the Acquire's trace through it.
        entry = R.QueueValue(job, lease, hint, R.now_ms(), self.replica, attempt, trace=tracing.traceparent(),
                             last_hold_ms=last_hold_ms, peak_bytes=peak_bytes, context_bytes=context_bytes)
        if exclusive and not spec.shared:
            exclusive = False              # an exclusive group's every grant is alone already: stored as before
        entry = dataclasses.replace(entry, exclusive=exclusive)
        movable = RK.movable(spec)
        if movable:
            # The leader may re-key the entry (priority classes, a fit group's backfill): its arrival travels.
            entry = dataclasses.replace(entry, priority=priority, **(await self._arrival(group, job, lease)))
        value = entry.dump()
        token: int | None = None
        wake = self.waiters.register(group, job)
        try:
            # Inside the try: a call cancelled while its write is in flight still
            # removes what the write may have left (see _abandon).
            token, revision, spec_rev = await self._enqueue(group, job, lease, value, seq, spec_rev)
            # Our own write must be in the mirror before we judge "entry gone".
            try:
                await self.reflector.wait_revision(revision, timeout)
            except asyncio.TimeoutError:
                raise AcquireTimeout(f"{job!r} was not granted {group!r} within {timeout:.3f}s (this replica's "
                                     "view of etcd lags); its place in the queue was given up") from None
            deadline = None if timeout is None else t0 + timeout
            while True:
                wake.clear()
                moving = False
                if movable:
                    # The leader may have moved our entry under a fresh key (rekey.py): follow it.
                    token, value, moving = self._follow(group, job, token, value)
                outcome = None if moving else self._outcome(group, job, token, attempt, spec_rev)
                if outcome is not None:
                    return Granted(token, outcome, (time.monotonic() - t0) * 1000)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise AcquireTimeout(f"{job!r} was not granted {group!r} within {timeout:.3f}s; "
                                         "its place in the queue was given up")
                try:
                    await asyncio.wait_for(wake.wait(), remaining)
                except asyncio.TimeoutError:
                    continue
        except BaseException:
            # Cancelled, timed out or failed: leave no ghost waiter. If the grant
            # raced in, this also releases it (an unclaimed grant is a yield).
            await asyncio.shield(self._abandon(group, job, token, value, movable))
            raise
        finally:
            self.waiters.unregister(group, job, wake)

    async def _enqueue(self, group: str, job: str, lease: int, value: bytes, seq: int,
                       spec_rev: int) -> tuple[int, int, int]:
        """Create or take over the job's entry in the group incarnation ``spec_rev``; returns
        (token, revision of our write, spec_rev). NotFound if the group is gone."""
        for _ in range(MAX_SPEC_TRIES):
            # Guarded by the group's spec: an entry written after a DeleteGroup would outlive it
            # without a spec (granted for nothing, and blocking the group created again under the
            # name), and a holder granted after the delete read the queue would never be told.
            guard = [ops.create_rev(self.keys.spec(group), "==", spec_rev)]
            try:
                token, revision = await self._enqueue_once(group, job, lease, value, seq, guard)
                return token, revision, spec_rev
            except GuardFailed:
                spec_rev = await self._spec_rev(group, fresh=True)   # deleted (NotFound), or created again
            except OutcomeUnknown:
                # Resolved by reading, never by blindly writing again: did our write land?
                r = await self.client.range(ops.range_req(self.keys.queue_entry(group, job)))
                if r.kvs and r.kvs[0].value == value:
                    return r.kvs[0].create_revision, r.header.revision, spec_rev
                raise
        raise EtcdUnavailable(f"group {group!r} was deleted and created again while {job!r} joined it; try again")

    async def _enqueue_once(self, group: str, job: str, lease: int, value: bytes, seq: int,
                            guard: list) -> tuple[int, int]:
        if seq > 0:
            c = await self.fence.claim(group, job, lease, seq, value, guard)
            return c.token, c.revision
        # An unnumbered attempt (older client): the last one processed wins.
        queue = FifoQueue(self.client, self.keys.queue(group))
        # No head read: the leader decides the turn; we wait for our grant in the mirror.
        entry = await queue.enqueue(job, value, lease, with_head=False, guard=guard)
        if entry.lease != lease:
            raise LockError(f"job {job!r} is queued on {group!r} under an older session")
        if entry.created:
            return entry.token, entry.revision
        # Take the existing entry over; a put keeps its create revision (place, token).
        resp = await self.client.txn([ops.create_rev(entry.key, "==", entry.token)],
                                     [ops.put(entry.key, value, lease)])
        if not resp.succeeded:
            raise SessionLost(f"{job!r} lost its place in {group!r} while re-sending Acquire")
        return entry.token, resp.header.revision

    def _follow(self, group: str, job: str, token: int, value: bytes) -> tuple[int, bytes, bool]:
        """(token, value, moving) of our entry in a priority group: under a fresh key once the
        leader moved it (same attempt, so the bytes ``moved_value`` gives), or out in ``moving``."""
        gs = self.index.groups.get(group)
        if gs is None:
            return token, value, False
        moved = RK.moved_value(value, token)
        kv = gs.queue.get(job)
        if kv is not None and kv.create_revision != token and kv.value == moved:
            return kv.create_revision, moved, False
        mk = gs.moving.get(job)
        return token, value, kv is None and mk is not None and mk.value == moved

    def _outcome(self, group: str, job: str, token: int, attempt: str, spec_rev: int) -> R.GrantValue | None:
        gs = self.index.groups.get(group)
        gkv = gs.grant_of(job) if gs is not None else None
        if gkv is not None:
            g = R.GrantValue.load(gkv.value)
            if g.job == job and g.token == token:
                return g
        fkv = gs.failures.get(job) if gs else None
        if fkv is not None:
            f = R.FailureValue.load(fkv.value)
            if f.token == token:
                raise SwapFailed(f"{job!r} could not be granted {group!r}: {f.reason}")
        if gs is None or job not in gs.queue or gs.queue[job].create_revision != token:
            if gs is None or gs.spec is None or gs.spec.create_revision != spec_rev:
                raise NotFound(f"group {group!r} was deleted while {job!r} waited")
            raise SessionLost(f"{job!r} lost its place in {group!r}: its session lease expired")
        if R.QueueValue.load(gs.queue[job].value).attempt != attempt:
            raise Superseded(f"a newer Acquire of {job!r} on {group!r} took over this one's place")
        return None

    async def _abandon(self, group: str, job: str, token: int | None, value: bytes, movable: bool = False) -> None:
        """``movable``: a priority group, where the leader may have moved the entry (rekey.py)."""
        try:
            if token is None:
                # Our write's outcome is unknown: find out whether the entry is ours.
                r = await self.client.range(ops.range_req(self.keys.queue_entry(group, job)))
                if not r.kvs or r.kvs[0].value != value:
                    return
                token = r.kvs[0].create_revision
            await self._release(group, job, token, only_if_value=value)
            if movable:
                # After the entry as we know it: if it was moved out before, it is found below.
                await self._abandon_moved(group, job, RK.moved_value(value, token))
        except Exception:
            pass  # the session lease removes the entry anyway when the job dies

    async def _abandon_moved(self, group: str, job: str, moved: bytes) -> None:
        """Our entry as the leader may have moved it (rekey.py): out in ``moving``, or in again
        under a fresh key. The marker first, then the entry (a move in between is then seen)."""
        # Only our own marker (its value carries our attempt id).
        await self.client.txn([ops.value_is(self.keys.moving(group, job), "==", moved)],
                              [ops.delete(self.keys.moving(group, job))])
        r = await self.client.range(ops.range_req(self.keys.queue_entry(group, job)))
        if r.kvs and r.kvs[0].value == moved:
            await self._release(group, job, r.kvs[0].create_revision, only_if_value=moved)

    async def _release(self, group: str, job: str, token: int, only_if_value: bytes | None = None,
                       handoff: bool = False) -> tuple[rpc.TxnResponse, tuple[R.GrantValue, bool] | None]:
        """Delete the job's entry (and its grant); returns (response, (grant handed on directly, made beside
        another holder) or None)."""
        qkey = self.keys.queue_entry(group, job)
        gs = self.index.groups.get(group)
        # Any key left in the queue means someone waits (no sort: etcd sorts before limiting).
        success = [ops.delete(qkey), ops.get(self.keys.queue(group), prefix=True, limit=2, keys_only=True)]
        direct, shared = None, False
        mine = gs.grant_of(job) if gs is not None else None
        if gs is not None and mine is not None:
            # Drop our grant in the same revision, but only that exact grant; on the
            # leader, hand the group straight to the next job in the same transaction.
            lead = self.leadership() if handoff and gs.spec is not None else None
            nxt = H.next_grant(self.index, group, job, self.policy) if lead is not None else None
            if lead is not None and nxt is not None and gs.spec is not None:
                op, direct = H.grant_or_drop(self.keys, lead, group, mine.key, mine.value, nxt,
                                             gs.spec.create_revision)
                success.append(op)
                shared = nxt.shared and any(j not in (job, nxt.job) for j in gs.holders())
            else:
                success.append(H.drop_only(mine.key, mine.value))
        # Guarded by the token: a stale Yield can never delete a newer entry of the job;
        # an abandoned attempt also by its value: it may only remove what it still owns.
        cmp = [ops.create_rev(qkey, "==", token)]
        if only_if_value is not None:
            cmp.append(ops.value_is(qkey, "==", only_if_value))
        resp = await self.client.txn(cmp, success, [ops.get(qkey)])
        if direct is not None and not (resp.succeeded and resp.responses[2].response_txn.succeeded):
            direct = None
        return resp, (direct, shared) if direct is not None else None

    @staticmethod
    def _granted(kv, job: str, token: int) -> bool:
        if kv is None:
            return False
        g = R.GrantValue.load(kv.value)
        return g.job == job and g.token == token

    async def yield_(self, job: str, group: str, token: int) -> tuple[bool, bool]:
        """Returns (released, deferred_snapshot)."""
        check_id("job", job), check_id("group", group)
        if token <= 0:
            raise InvalidIdError("token must be the positive token Acquire returned")
        await self._require_group(group)
        gs = self.index.groups.get(group)
        kv = gs.queue.get(job) if gs else None
        if (gs is not None and kv is not None and kv.create_revision == token
                and not self._granted(gs.grant_of(job), job, token)):
            # The mirror may not show a grant made a moment ago: ask etcd itself.
            shared = gs.parsed is not None and gs.parsed.shared
            r = await self.client.range(ops.range_req(self.keys.grant_key(group, job, shared)))
            if not r.kvs or not self._granted(r.kvs[0], job, token):
                raise NotHolder(f"not_holder: {job!r} is waiting for {group!r}, it does not hold it; "
                                "cancel the Acquire instead")
        resp, direct = await self._release(group, job, token, handoff=True)
        if direct is not None and self.on_direct_grant is not None:
            self.on_direct_grant(group, *direct)
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if kvs:
                raise StaleToken(f"stale_token: token {token} is not {job!r}'s current token "
                                 f"{kvs[0].create_revision} on {group!r}")
            raise NotHolder(f"not_queued: {job!r} does not hold {group!r} (already yielded, or never "
                            "acquired)")
        nobody_waits = not any(kv.key != self.keys.queue_entry(group, job)
                               for kv in resp.responses[1].response_range.kvs)
        return True, nobody_waits
