"""The leader's profile recorder: feeds the ProfileBook from the watch stream, keeps it in etcd.

Only the leader records (it alone sees every grant it writes at the moment it
writes it, and its epoch fences the writes). A new leader starts from what
etcd holds under ``profiles/`` and from the queue entries and grants that
exist then, so a failover loses at most the phases in flight while nobody
led. Dirty profiles are written every ``flush_s`` seconds in leader-guarded
transactions; a failed write keeps them dirty for the next round.

Every replica serves ``GetProfiles`` from its mirror (``stored``), so a reader
needs no leader.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from timeslice.common import records as R
from timeslice.common.errors import NotLeader, TimesliceError
from timeslice.common.etcd import ops
from timeslice.common.etcd.election import Leadership
from timeslice.common.etcd.watch import WatchEvent
from timeslice.common.keys import Keys
from timeslice.lockd.index import KV, StateIndex
from timeslice.lockd.metrics import Metrics
from timeslice.lockd.profiles import ProfileBook, fractions

log = structlog.get_logger("lockd.profiles")

DEFAULT_FLUSH_S = 2.0
TXN_OPS = 64              # etcd refuses transactions of more than 128 operations (default)
MAX_DEVICES = 64          # device entries kept per profile (an agent reports a node's devices)


def load_stored(keys: Keys, kvs: Iterable[KV]) -> list[R.ProfileValue]:
    """The profiles among mirrored key-values (unreadable ones are skipped)."""
    prefix = keys.profiles()
    out = []
    for kv in kvs:
        if kv.key.startswith(prefix):
            try:
                out.append(R.ProfileValue.load(kv.value))
            except (ValueError, TypeError):
                log.warning("profile_unreadable", key=kv.key.decode(errors="replace")[:200])
    return out


class ProfileRecorder:
    def __init__(self, keys: Keys, index: StateIndex, metrics: Metrics, book: ProfileBook | None = None,
                 flush_s: float = DEFAULT_FLUSH_S):
        if flush_s <= 0:
            raise ValueError("flush_s must be > 0")
        self.keys, self.index, self.metrics, self.flush_s = keys, index, metrics, flush_s
        self.book = book or ProfileBook()
        self.lead: Leadership | None = None
        self._ops_seen: set[tuple[bytes, int]] = set()

    # -- a term ------------------------------------------------------------------------
    async def run(self, lead: Leadership, kvs: Iterable[KV]) -> None:
        """While leading: start from etcd's profiles and today's queues, then flush until cancelled."""
        self.book.load(load_stored(self.keys, kvs))
        self._reopen()
        self.lead = lead
        try:
            while True:
                await asyncio.sleep(self.flush_s)
                await self.flush()
        finally:
            self.lead = None

    def _reopen(self) -> None:
        for group, gs in self.index.groups.items():
            grant = _load(R.GrantValue, gs.grant)
            for job, kv in gs.queue.items():
                q = _load(R.QueueValue, kv)
                granted = grant.granted_ms if grant and grant.job == job and grant.token == kv.create_revision else 0
                self.book.reopen(group, job, kv.create_revision, q.enqueued_ms if q else R.now_ms(), granted)

    async def flush(self) -> None:
        lead = self.lead
        dirty, gone = self.book.take_dirty()
        self._export_fractions()
        if lead is None or not (dirty or gone):
            return
        puts = [ops.put(self.keys.profile(p.group, p.job), p.dump()) for p in dirty]
        dels = [ops.delete(self.keys.profile(g, j)) for g, j in gone]
        batch = puts + dels
        try:
            for i in range(0, len(batch), TXN_OPS):
                # Leader-guarded: a deposed leader's stale book never overwrites the new leader's.
                # Not leased: a profile outlives its job's session (advise reads finished jobs too).
                await lead.txn([], batch[i:i + TXN_OPS])
        except NotLeader:
            raise
        except TimesliceError as e:
            self.book.put_back(dirty, gone)
            log.warning("profiles_write_failed", profiles=len(dirty), error=str(e)[:200])

    def _export_fractions(self) -> None:
        self.metrics.job_fractions.values = {k: fractions(p) for k, p in self.book.profiles.items()}

    # -- the watch stream -------------------------------------------------------------------
    def on_batch(self, events: list[WatchEvent], reset: bool) -> None:
        if self.lead is None:
            return
        if reset:
            self._reopen()            # what happened in the gap is not known; go on from now
            return
        now = R.now_ms()
        for ev in events:
            try:
                parts = self.keys.parse(ev.kv.key)
            except ValueError:
                continue
            if len(parts) == 4 and parts[0] == "groups" and parts[2] == "queue":
                self._queue(parts[1], parts[3], ev, now)
            elif len(parts) == 3 and parts[0] == "groups" and parts[2] == "grant" and ev.is_put:
                g = _load(R.GrantValue, ev.kv)
                if g is not None:
                    self.book.granted(parts[1], g.job, g.token, g.granted_ms or now, g.restored, g.elided)
            elif len(parts) == 4 and parts[0] == "nodes" and parts[2] == "status" and ev.is_put:
                self._status(ev.kv, now)
            elif len(parts) == 3 and parts[0] == "nodes" and parts[2] == "agent" and ev.is_put:
                self._agent(parts[1], ev.kv, now)

    def _queue(self, group: str, job: str, ev: WatchEvent, now: int) -> None:
        if not ev.is_put:
            self.book.left(group, job, None, now)
            return
        q = _load(R.QueueValue, ev.kv)
        if q is not None:
            self.book.enqueued(group, job, ev.kv.create_revision, q.enqueued_ms or now, q.device_bytes_hint,
                               q.last_hold_ms)

    def _status(self, kv: KV, now: int) -> None:
        st = _load(R.StatusValue, kv)
        if st is None or st.outcome != R.OK or st.intent_revision <= 0:
            return
        seen = (kv.key, st.intent_revision)
        if seen in self._ops_seen:
            return                     # agents re-put statuses (corrections): count an op once
        self._ops_seen.add(seen)
        if len(self._ops_seen) > 10000:
            self._ops_seen.clear()
        self.book.swapped(st.group, st.job, st.op, st.elapsed_ms, st.bytes, st.device_bytes, now)

    def _agent(self, node: str, kv: KV, now: int) -> None:
        av = _load(R.AgentValue, kv)
        if av is None or not isinstance(av.job_gpus, dict):
            return
        groups = self.index.groups_on_node(node)
        for job, per_dev in av.job_gpus.items():
            if isinstance(job, str) and isinstance(per_dev, dict) and per_dev:
                self.book.footprint(groups, job, node, dict(list(per_dev.items())[:MAX_DEVICES]), now)


def _load(cls, kv):
    if kv is None:
        return None
    try:
        return cls.load(kv.value)
    except (ValueError, TypeError):
        return None
