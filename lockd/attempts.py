"""The client's order of its Acquire attempts, enforced in etcd.

A client re-sends an Acquire when its replica fails or stalls, and numbers
every (re-)send (``AcquireRequest.attempt_seq``, strictly increasing per
session). A replica that was paused may process an *old* attempt long after
a newer one was served elsewhere: without an order, that old attempt would
take the job's queue entry over (the live call then ends CANCELLED and the
grant goes to a call nobody waits for), or, after the job yielded, enqueue
the job again and be granted for nobody: a ghost holder.

So each (group, job) has a fence key ``groups/<g>/attempts/<job>``
(``{"seq": n}``, leased to the job's session, so it lives exactly as long as
the session whose attempts it orders) holding the largest number that has
claimed the queue entry. ``claim`` is one compare-and-swap transaction:

    If   mod_revision(fence) == m        no other attempt claimed since we looked
     and create_revision(entry) == c     0: absent, we create it; else the entry we saw
    Then put fence = seq, put entry      a put keeps create_revision: place and token
    Else get fence, get entry            re-judge from what etcd holds now

An attempt whose number is below the fence's is stale and changes nothing.
The first guess of m comes from the replica's mirror and c is guessed 0 (a
fresh Acquire), so the usual path is one round trip; a wrong guess (a re-sent
attempt, a mirror that lags) costs one more.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from aetcd import rpc

from timeslice.common.errors import EtcdUnavailable, GuardFailed, LockError
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.lockd.errors import Superseded

#: Tries of the compare-and-swap before giving up (UNAVAILABLE: the client re-sends).
#: Each failed try means a concurrent write to this job's entry, which only the job's
#: own attempts and its grant's end make: a handful is plenty.
MAX_TRIES = 8


@dataclass(frozen=True)
class Claim:
    token: int          # create_revision of the queue entry (the fencing token)
    revision: int       # store revision of our write
    created: bool


def fence_seq(raw: bytes | None) -> int:
    if not raw:
        return 0
    try:
        return int(json.loads(raw).get("seq", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


class AttemptFence:
    def __init__(self, client: EtcdClient, keys: Keys, reflector: Reflector):
        self.client, self.keys, self.reflector = client, keys, reflector

    async def claim(self, group: str, job: str, lease: int, seq: int, value: bytes,
                    guard: Sequence[rpc.Compare] = ()) -> Claim:
        """Create or take over ``job``'s entry in ``group`` as attempt ``seq``; raises if stale.
        ``guard``: compares the claim runs inside (the group's spec, see locks.py); ``GuardFailed``
        if they do not hold."""
        fkey, qkey = self.keys.attempt(group, job), self.keys.queue_entry(group, job)
        # First guess: the fence as this replica's mirror shows it (only the job's own
        # attempts write it), and no entry (a fresh Acquire; a re-send costs a retry).
        fkv, qkv = self.reflector.get(fkey), None
        m = fkv.mod_revision if fkv is not None else 0
        c = 0
        for _ in range(MAX_TRIES):
            if fkv is not None and fence_seq(fkv.value) > seq:
                raise Superseded(f"a newer Acquire attempt of {job!r} on {group!r} "
                                 f"(#{fence_seq(fkv.value)}) was already served; this one (#{seq}) is stale")
            if qkv is not None and qkv.lease != lease:
                raise LockError(f"job {job!r} is queued on {group!r} under an older session")
            fence = json.dumps({"seq": seq}).encode()
            # One CAS: the fence and the entry move together, or neither does.
            cas = ([ops.mod_rev(fkey, "==", m), ops.create_rev(qkey, "==", c)],
                   [ops.put(fkey, fence, lease), ops.put(qkey, value, lease)],
                   [ops.get(fkey), ops.get(qkey)])
            if guard:
                # Nested in the guard, still one round trip: no entry is written unless it holds.
                outer = await self.client.txn(list(guard), [ops.nested(*cas)])
                if not outer.succeeded:
                    raise GuardFailed(f"Acquire of {job!r} on {group!r}: the group changed under it")
                resp, rev = outer.responses[0].response_txn, outer.header.revision
            else:
                resp = await self.client.txn(*cas)
                rev = resp.header.revision
            if resp.succeeded:
                return Claim(c or rev, rev, created=c == 0)
            fkvs = resp.responses[0].response_range.kvs
            qkvs = resp.responses[1].response_range.kvs
            fkv, qkv = (fkvs[0] if fkvs else None), (qkvs[0] if qkvs else None)
            m = fkv.mod_revision if fkv is not None else 0
            c = qkv.create_revision if qkv is not None else 0
        raise EtcdUnavailable(f"Acquire of {job!r} on {group!r}: the queue entry kept changing; try again")
