"""Leader election: the FIFO queue's head is the leader.

A candidate puts ``<election>/<lease-hex>`` with its session lease; the lowest
create_revision leads. The leader's *epoch* is that create_revision. Every
write the leader makes is a transaction guarded by
``create_revision(leader_key) == epoch`` (see ``Leadership.guard``), so a
leader that was paused past its lease and wakes up cannot write anything: its
key is gone (or re-created with another revision) and the guard fails.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aetcd import rpc

from timeslice.common.errors import NotLeader
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.queue import Entry, FifoQueue
from timeslice.common.server.etcd.session import Session
from timeslice.common.server.etcd.watch import Watch


@dataclass(frozen=True)
class LeaderInfo:
    key: bytes
    value: bytes
    epoch: int


@dataclass(frozen=True)
class Leadership:
    """Held leadership: the key and epoch that fence the leader's writes."""

    key: bytes
    epoch: int
    session: Session

    def guard(self) -> rpc.Compare:
        """The compare that makes a transaction leader-only."""
        return ops.create_rev(self.key, "==", self.epoch)

    async def txn(self, compare=(), success=(), failure=()):
        """A transaction guarded by this leadership; raises NotLeader if deposed.

        ``compare`` are extra conditions; if the leader guard holds but they do
        not, the response is returned with succeeded=False (check it). The
        guard is checked in the failure branch by reading the leader key.
        """
        self.session.check()
        resp = await self.session.client.txn(
            [self.guard(), *compare], success, [ops.get(self.key), *failure])
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if not kvs or kvs[0].create_revision != self.epoch:
                raise NotLeader(f"leadership epoch {self.epoch} is over")
        return resp


class Election:
    def __init__(self, session: Session, prefix: bytes, value: bytes = b""):
        self.session = session
        self.queue = FifoQueue(session.client, prefix)
        self.value = value
        self._entry: Entry | None = None

    @property
    def name(self) -> str:
        return f"{self.session.lease_id:x}"

    async def campaign(self) -> Leadership:
        """Become a candidate and block until leading. Cancellation withdraws.

        Raises SessionLost as soon as the session is lost while waiting (a
        standby paused past its lease: its key is gone, and waiting on for the
        predecessor would keep it out of the election until that one leaves);
        the caller starts over with a new session and so rejoins at once.
        """
        self.session.check()
        entry = await self.queue.enqueue(self.name, self.value, self.session.lease_id)
        self._entry = entry
        turn = asyncio.ensure_future(self.queue.wait_turn(entry))
        lost = asyncio.ensure_future(self.session.lost.wait())
        try:
            await asyncio.wait({turn, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not turn.done():
                self.session.check()              # raises SessionLost
            held = turn.result()
        except BaseException:
            await asyncio.shield(self.resign())
            raise
        finally:
            for t in (turn, lost):
                if not t.done():
                    t.cancel()
            # Collect them, so a cancelled watch is never left "destroyed but pending".
            await asyncio.gather(turn, lost, return_exceptions=True)
        return Leadership(held.key, held.token, self.session)

    async def resign(self) -> None:
        """Withdraw (or step down) at once, so the next candidate leads without waiting for the TTL."""
        entry, self._entry = self._entry, None
        if entry is not None:
            try:
                await self.queue.remove(entry)
            except Exception:
                pass  # our lease will expire and remove the key anyway

    async def leader(self) -> LeaderInfo | None:
        head = await self.queue.head()
        return LeaderInfo(head.key, head.value, head.create_revision) if head else None

    async def observe(self) -> AsyncIterator[LeaderInfo | None]:
        """Yield the current leader, then every change of leader."""
        last = object()
        while True:
            rev, kvs = await self.queue.entries()
            cur = LeaderInfo(kvs[0].key, kvs[0].value, kvs[0].create_revision) if kvs else None
            if cur != last:
                last = cur
                yield cur
            async with Watch(self.session.client, self.queue.prefix, prefix=True,
                             start_revision=rev + 1) as w:
                async for _ in w:
                    break  # any change under the election prefix: re-read


async def wait_deposed(leadership: Leadership) -> str:
    """Return (with the reason) when the leadership is lost: key deleted or session lost."""
    client = leadership.session.client
    r = await client.range(ops.range_req(leadership.key))
    if not r.kvs or r.kvs[0].create_revision != leadership.epoch:
        return "leader key gone"
    lost = asyncio.ensure_future(leadership.session.lost.wait())

    async def key_deleted():
        async with Watch(client, leadership.key, start_revision=r.header.revision + 1) as w:
            async for batch in w:
                if any(not ev.is_put for ev in batch):
                    return

    gone = asyncio.ensure_future(key_deleted())
    try:
        done, _ = await asyncio.wait({lost, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        gone.cancel()
    return "session lost" if lost in done else "leader key deleted"
