"""Telling a job that an admin deleted a group under it.

A forced DeleteGroup removes the group's queue, so its holder would otherwise
learn nothing until some later call failed with a generic "not queued" (and a
re-created group's grant to another job would look like an ordinary handoff).
Before the delete, one notice per queued job is written under
``jobs/<job>/revoked/<group>`` ({group, token, held}), leased to the job's own
session so it can never outlive the job. The job's next Yield of that group
with that token gets ABORTED "group_deleted: ..." and the notice is consumed;
until then every KeepAlive reply lists the group (``revoked_groups``), so a
holder in the middle of its GPU phase learns of it within a keepalive period.
A Yield pays nothing on the normal path (only a Yield that already failed
looks for a notice); a KeepAlive pays one small keys-only read.
"""
from __future__ import annotations

from collections.abc import Collection

from timeslice.common.errors import EtcdLeaseGone
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.lockd.errors import GroupRevoked

MAX_LISTED = 64      # revoked groups a KeepAlive reply lists
BATCH = 64          # puts per transaction: etcd refuses a txn of more than --max-txn-ops (128) operations


class RevocationNotices:
    def __init__(self, client: EtcdClient, keys: Keys):
        self.client, self.keys = client, keys

    async def notify(self, group: str, queue_kvs, holders: Collection[str] | None = None) -> int:
        """Write a notice for every queue entry in ``queue_kvs`` (a range of the group's queue).
        ``holders``: the jobs the grants name, if any (else the head: the first entry; in a group with
        priority classes the head need not be the oldest entry)."""
        entries = sorted(queue_kvs, key=lambda kv: kv.create_revision)
        now, written = R.now_ms(), 0
        for i in range(0, len(entries), BATCH):
            batch = entries[i:i + BATCH]
            puts = [ops.put(self.keys.revoked(self.keys.parse(kv.key)[3], group),
                            R.RevokedValue(group, kv.create_revision, now,
                                           held=(self.keys.parse(kv.key)[3] in holders if holders is not None
                                                 else i == 0 and j == 0)).dump(),
                            kv.lease)
                    for j, kv in enumerate(batch) if kv.lease]
            try:
                # One txn per batch; each notice rides on its job's session lease.
                await self.client.txn([], puts)
                written += len(puts)
            except EtcdLeaseGone:
                # A job's session ended meanwhile: it cannot be told, and it holds nothing any more.
                for put in puts:
                    try:
                        await self.client.txn([], [put])
                        written += 1
                    except EtcdLeaseGone:
                        continue
        return written

    async def pending(self, job: str) -> list[str]:
        """Groups deleted under ``job`` that its Yield has not been told of yet (at most MAX_LISTED)."""
        prefix = self.keys.revocations(job)
        # Keys only, bounded: one small read per keepalive (a few per minute per job).
        r = await self.client.range(ops.range_req(prefix, prefix=True, keys_only=True, limit=MAX_LISTED))
        return [kv.key[len(prefix):].decode() for kv in r.kvs]

    async def raise_if_revoked(self, job: str, group: str, token: int) -> None:
        """After a failed Yield: raise GroupRevoked if the group was deleted under this very hold."""
        key = self.keys.revoked(job, group)
        r = await self.client.range(ops.range_req(key))
        if not r.kvs:
            return
        note = R.RevokedValue.load(r.kvs[0].value)
        if note.token != token:
            return
        # Consume it (only this exact notice: a newer one written meanwhile stays).
        await self.client.txn([ops.mod_rev(key, "==", r.kvs[0].mod_revision)], [ops.delete(key)])
        raise GroupRevoked(
            f"group_deleted: an admin deleted group {group!r} while job {job!r} "
            f"{'held' if note.held else 'was queued for'} it (token {token}); the hold ended then, and "
            "whatever ran after that ran without the lock")
