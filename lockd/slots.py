"""Count limits held in etcd itself: each counted thing takes one of ``limit`` numbered slots.

A limit checked on a replica's mirror and then written is a race: parallel calls, on one
replica or on several, all see room and all write (2,348 parallel OpenSession calls of one
caller over 3 replicas left 2,075 sessions against a limit of 2,048). So a session, a
session of one caller and a worker of one job each take a *slot*: the key
``slots/<space>/<n>`` with ``n`` in ``0..limit-1``, created only if absent in the same
transaction as the thing itself, leased like it and deleted with it. No more than ``limit``
slot keys can exist at once, so no more than ``limit`` things: bounded by construction, across
every replica. A slot a parallel call took first costs one more try with another one; the
mirror says which are free, and a random pick keeps parallel callers apart.

Spaces: ``sessions`` (--max-sessions), ``peers/<digest>`` (--max-sessions-per-peer, the
digest of the caller's identity: lockd.callers), ``workers/<job>`` (max_workers_per_job).
The decisions are sans-IO; the services (sessions.py, workers.py) write, and ``taken_now``
reads etcd before a refusal.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Collection

from timeslice.common.ids import check_id
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys

SESSIONS = "sessions"
#: Transactions one call makes while parallel calls keep taking the slot it picked.
MAX_TRIES = 16
_PROBES = 8           # random picks tried before looking at every slot


def peer_space(peer: str) -> str:
    # A digest: a caller's identity (a TLS common name) may hold any character, a key segment may not.
    return "peers/" + hashlib.sha256(peer.encode()).hexdigest()[:32]


def worker_space(job: str) -> str:
    return "workers/" + check_id("job", job)


def pick(taken: Collection[int], limit: int, rng: random.Random) -> int:
    """A free slot in ``0..limit-1`` (not in ``taken``), at random. The caller has checked that
    fewer than ``limit`` are taken, so one is free."""
    for _ in range(_PROBES):
        n = rng.randrange(limit)
        if n not in taken:
            return n
    free = [n for n in range(limit) if n not in taken]
    if not free:
        raise ValueError(f"all {limit} slots are taken")
    return rng.choice(free)


async def taken_now(client: EtcdClient, keys: Keys, space: str) -> set[int]:
    """The slots of ``space`` taken in etcd now. A replica's mirror may still show a slot freed a
    moment ago on another replica: a refusal is checked against this read before it is given."""
    prefix = keys.slots(space)
    # Keys only: at most ``limit`` small keys, read only when the mirror says the limit is reached.
    r = await client.range(ops.range_req(prefix, prefix=True, keys_only=True))
    tail = (kv.key[len(prefix):] for kv in r.kvs)
    return {int(t) for t in tail if t.isdigit()}
