"""The FIFO queue: a fair lock whose order is etcd's create revision.

Each contender puts one key ``<prefix><name>`` attached to its session lease.
The key with the lowest create_revision is the head, which owns the lock.
The head's create_revision is its fencing token: cluster-wide, strictly
increasing, durable. (Lease ids are not ordered and are never used as tokens.)

A waiter watches only its immediate predecessor (no thundering herd) from the
revision of the read that found it, so a delete can never slip by unseen.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aetcd import rpc

from timeslice.common.errors import GuardFailed, SessionLost, WatchCompacted
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.watch import DELETE, Watch


@dataclass(frozen=True)
class Entry:
    key: bytes
    token: int                      # create_revision of the key
    lease: int
    value: bytes
    revision: int                   # store revision at which this was read
    head: rpc.KeyValue | None       # the queue head when read (None: empty)
    created: bool = False           # True when this call created the key

    @property
    def is_head(self) -> bool:
        return self.head is not None and self.head.key == self.key


class FifoQueue:
    def __init__(self, client: EtcdClient, prefix: bytes):
        if not prefix.endswith(b"/"):
            raise ValueError("queue prefix must end with '/'")
        self.client = client
        self.prefix = prefix

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    async def enqueue(self, name: str, value: bytes, lease: int, with_head: bool = True,
                      guard: Sequence[rpc.Compare] = ()) -> Entry:
        """Join the queue, or find our existing place: never enqueues twice.

        One transaction creates the key if absent and reads the head, so the
        uncontended path is a single round trip, and a retried call (after a
        lost reply) lands on the failure branch and returns the same entry.
        ``with_head=False`` skips the head read (etcd sorts the whole queue to
        answer it) for callers that learn their turn another way. ``guard``:
        compares that must hold for anything to happen (e.g. "the queue's
        owner still exists"); the decision runs nested inside them, in the
        same transaction, and ``GuardFailed`` says they did not hold.
        """
        key = self.key(name)
        head_op = [ops.first_in(self.prefix)] if with_head else []
        cmp, success, failure = [ops.create_rev(key, "==", 0)], [ops.put(key, value, lease), *head_op], \
            [ops.get(key), *head_op]
        if guard:
            # One round trip still: the guard outside, the create-if-absent inside.
            outer = await self.client.txn(list(guard), [ops.nested(cmp, success, failure)])
            if not outer.succeeded:
                raise GuardFailed(f"not queued in {self.prefix!r}: its guard no longer holds")
            resp, rev = outer.responses[0].response_txn, outer.header.revision
        else:
            resp = await self.client.txn(cmp, success, failure)
            rev = resp.header.revision
        head_kvs = resp.responses[1].response_range.kvs if with_head else ()
        head = head_kvs[0] if head_kvs else None
        if resp.succeeded:
            # Our put is the txn's revision, hence our create_revision.
            return Entry(key, rev, lease, value, rev, head, created=True)
        kv = resp.responses[0].response_range.kvs[0]
        return Entry(key, kv.create_revision, kv.lease, kv.value, rev, head)

    async def entries(self) -> tuple[int, list[rpc.KeyValue]]:
        """(revision, every entry in FIFO order)."""
        r = await self.client.range(ops.range_req(self.prefix, prefix=True, by_create="asc"))
        return r.header.revision, list(r.kvs)

    async def head(self) -> rpc.KeyValue | None:
        r = await self.client.range(ops.range_req(self.prefix, prefix=True, limit=1, by_create="asc"))
        return r.kvs[0] if r.kvs else None

    async def wait_turn(self, entry: Entry) -> Entry:
        """Block until ``entry`` is the head; returns it re-read.

        Cancellation leaves the key in place: call ``remove`` (the lease removes it
        otherwise).
        """
        while True:
            # The predecessor: the newest key created before ours.
            r = await self.client.range(ops.range_req(
                self.prefix, prefix=True, limit=1, by_create="desc",
                max_create_revision=entry.token - 1))
            if not r.kvs:
                break
            pred = r.kvs[0]
            # Watch from just after the read: a delete at any later revision is seen.
            try:
                async with Watch(self.client, pred.key, start_revision=r.header.revision + 1) as w:
                    async for batch in w:
                        if any(ev.type == DELETE for ev in batch):
                            break
            except WatchCompacted:
                continue  # history is gone: just look at the predecessor again
        # Re-read our own key: if our lease died while we waited, the key is
        # gone and we must not be told we hold the lock.
        r = await self.client.range(ops.range_req(entry.key))
        if not r.kvs or r.kvs[0].create_revision != entry.token:
            raise SessionLost(f"queue entry {entry.key!r} vanished while waiting (lease expired?)")
        kv = r.kvs[0]
        return Entry(entry.key, entry.token, kv.lease, kv.value, r.header.revision, kv)

    async def remove(self, entry: Entry) -> bool:
        """Delete our key, guarded by the token: never deletes a newer entry of the same name."""
        resp = await self.client.txn([ops.create_rev(entry.key, "==", entry.token)], [ops.delete(entry.key)])
        return resp.succeeded

