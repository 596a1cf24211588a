"""A bounded history of finished holds, written by the leader, read by ``timeslice report``.

Why it exists: lockd's keys in etcd are the present (the grant, the queue, the agents'
last answers). Once a job yields, nothing says who held a group when, what the swap
that let it in moved and how long it took, or how long the job waited; etcd's own
revision history has no clock and is compacted away. So the leader writes one record
per finished hold, ``<prefix>history/<group>/<token>`` (``records.HoldRecord``): the
grant (job, token, restored, elided, bytes moved), the queue entry's enqueue time, the
release time, and the agents' answers to that grant's swap intents (per node: op,
bytes, time, bytes per GPU).

Bounds: at most ``per_group`` records per group and ``total`` in all (the oldest
go first: tokens are etcd revisions, so they order records across groups too), at
most ``MAX_SWAPS`` swap answers per record, at most ``MAX_PENDING`` records waiting
for a write (past it the oldest are dropped and counted in the log). Cost: no write
on the handoff path; at most ``MAX_TXNS_PER_FLUSH`` transactions per ``flush_s``, each
with up to ``MAX_TXN_OPS`` puts and deletes, guarded by the leader's epoch: a cluster
handing off faster than that (a benchmark, not RL jobs) keeps a sample, and says so.

``HistoryBook`` is the sans-IO part (mirror events in, writes out); ``History``
runs it on the replica: the book sees every batch while this replica leads, a task
writes what it made.
"""
from __future__ import annotations

import asyncio
import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import structlog

from timeslice.common.errors import TimesliceError
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.election import Leadership
from timeslice.common.server.etcd.watch import WatchEvent
from timeslice.common.server.keys import Keys

log = structlog.get_logger(__name__)

PER_GROUP = 256
TOTAL = 8192
MAX_SWAPS = 64
MAX_PENDING = 4096
MAX_TXN_OPS = 100          # etcd refuses more than --max-txn-ops (128 by default) in one transaction
MAX_TOKENS_WITH_SWAPS = 4096
FLUSH_S = 1.0
MAX_TXNS_PER_FLUSH = 4     # ~130 records a second at most; a faster stream is dropped, and logged


class HistoryBook:
    """Turns the mirror's events into finished-hold records and the writes that store them."""

    def __init__(self, keys: Keys, per_group: int = PER_GROUP, total: int = TOTAL):
        self.keys, self.per_group, self.total = keys, per_group, total
        self.epoch = 0
        self.open: dict[tuple[str, str], R.HoldRecord] = {}        # (group, job) -> its current hold
        self.swaps: OrderedDict[int, list[dict]] = OrderedDict()    # token -> agents' answers for it
        self._seen_answers: set[tuple[bytes, int]] = set()
        self.pending: list[R.HoldRecord] = []
        self.stored: dict[str, list[int]] = {}                      # group -> stored tokens, ascending
        self.dropped = 0

    # -- input -----------------------------------------------------------------------
    def reseed(self, kvs: Mapping[bytes, object], epoch: int, now_ms: int) -> None:
        """Start (or restart, after a mirror reset) from the whole state: the holds in progress
        and the records already stored."""
        self.epoch = epoch
        grants: dict[tuple[str, str], R.GrantValue] = {}
        self.stored = {}
        for key, kv in kvs.items():
            parts = self._parts(key)
            held = self.keys.grant_of(key) if parts and parts[0] == "groups" else None
            if held is not None:
                g = self._load(R.GrantValue, kv)
                if g is not None:
                    grants[(held[0], g.job)] = g
            elif len(parts) == 3 and parts[0] == "history" and parts[2].isdigit():
                self.stored.setdefault(parts[1], []).append(int(parts[2]))
        for tokens in self.stored.values():
            tokens.sort()
        for hold in list(self.open):
            g = grants.get(hold)
            if g is None or g.token != self.open[hold].token:
                self._close(hold, now_ms, kvs.get)
        for (group, job), g in grants.items():
            if (group, job) not in self.open:
                self._open(group, g, kvs.get, now_ms)

    def observe(self, events: Iterable[WatchEvent], lookup: Callable[[bytes], object | None], now_ms: int) -> None:
        for ev in events:
            parts = self._parts(ev.kv.key)
            held = self.keys.grant_of(ev.kv.key) if parts and parts[0] == "groups" else None
            if held is not None:
                self._on_grant(*held, ev, lookup, now_ms)
            elif len(parts) == 4 and parts[0] == "nodes" and parts[2] == "status" and ev.is_put:
                self._on_answer(parts[1], ev)

    def _on_grant(self, group: str, job: str, ev: WatchEvent, lookup, now_ms: int) -> None:
        """``job``: a fit group's holder (its grant has a key of its own); "" for an exclusive
        group's one grant key (whose value names the job)."""
        mine = [h for h in self.open if h[0] == group and (not job or h[1] == job)]
        if not ev.is_put:
            for hold in mine:
                self._close(hold, now_ms, lookup)     # yield, session loss, group deletion
            return
        g = self._load(R.GrantValue, ev.kv)
        if g is None:
            return
        cur = self.open.get((group, g.job))
        if cur is not None and cur.token == g.token:
            return                                    # the same grant re-put
        for hold in mine:                             # a direct handoff: the next grant replaced it
            self._close(hold, g.granted_ms or now_ms, lookup)
        self._open(group, g, lookup, now_ms)

    def _on_answer(self, node: str, ev: WatchEvent) -> None:
        st = self._load(R.StatusValue, ev.kv)
        if (st is None or st.outcome != R.OK or st.op not in (R.SNAPSHOT, R.RESTORE)
                or st.intent_revision <= 0 or st.token <= 0):
            return
        seen = (ev.kv.key, st.intent_revision)
        if seen in self._seen_answers:
            return                                    # the agent re-put its answer (a correction)
        self._seen_answers.add(seen)
        if len(self._seen_answers) > 4 * MAX_TOKENS_WITH_SWAPS:
            self._seen_answers.clear()
        answers = self.swaps.setdefault(st.token, [])
        if len(answers) < MAX_SWAPS:
            answers.append({"node": node, "job": st.job, "op": st.op, "bytes": st.bytes,
                            "elapsed_ms": st.elapsed_ms, "gpu_bytes": dict(st.gpu_bytes),
                            "done_ms": st.updated_ms, "residue_bytes": st.residue_bytes})
        while len(self.swaps) > MAX_TOKENS_WITH_SWAPS:
            self.swaps.popitem(last=False)            # answers for grants that never came (failed swaps)

    def _open(self, group: str, g: R.GrantValue, lookup, now_ms: int) -> None:
        entry = self._load(R.QueueValue, lookup(self.keys.queue_entry(group, g.job))) if g.job else None
        self.open[(group, g.job)] = R.HoldRecord(group, g.job, g.token, g.leader_epoch,
                                        enqueued_ms=entry.enqueued_ms if entry else 0,
                                        granted_ms=g.granted_ms or now_ms, restored=g.restored,
                                        elided=g.elided, bytes_moved=g.bytes_moved,
                                        hint_bytes=entry.device_bytes_hint if entry else 0,
                                        prev_busy_ms=entry.last_hold_ms if entry else 0,
                                        peak_bytes=entry.peak_bytes if entry else 0,
                                        context_bytes=entry.context_bytes if entry else 0,
                                        footprint=dict(g.footprint), exclusive=g.exclusive,
                                        backfilled=g.backfilled)

    def _close(self, hold: tuple[str, str], released_ms: int, lookup) -> None:
        rec = self.open.pop(hold, None)
        if rec is None:
            return
        group = hold[0]
        rec.released_ms = max(released_ms, rec.granted_ms)
        rec.gpu_bytes = self._footprint(group, rec.job, lookup)
        rec.swaps = self.swaps.pop(rec.token, [])
        self.pending.append(rec)
        if len(self.pending) > MAX_PENDING:
            drop = len(self.pending) - MAX_PENDING
            del self.pending[:drop]
            self.dropped += drop

    # -- output ----------------------------------------------------------------------------
    def take(self) -> tuple[list[tuple[bytes, bytes]], list[bytes], list[R.HoldRecord]]:
        """(puts, deletes, the records they store) for one transaction; the book counts them as
        stored (``give_back`` puts them back if the write did not happen)."""
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        taken: list[R.HoldRecord] = []
        # Each record is one put and at most two deletes (its group's oldest, the oldest of all).
        while self.pending and len(puts) + len(deletes) + 3 <= MAX_TXN_OPS:
            rec = self.pending.pop(0)
            taken.append(rec)
            puts.append((self.keys.history_entry(rec.group, rec.token), rec.dump()))
            bisect.insort(self.stored.setdefault(rec.group, []), rec.token)
            deletes += self._trim(rec.group)
        return puts, deletes, taken

    def give_back(self, taken: list[R.HoldRecord]) -> None:
        for rec in taken:
            tokens = self.stored.get(rec.group, [])
            if rec.token in tokens:
                tokens.remove(rec.token)
        self.pending[:0] = taken

    def _trim(self, group: str) -> list[bytes]:
        out = []
        tokens = self.stored[group]
        while len(tokens) > self.per_group:
            out.append(self.keys.history_entry(group, tokens.pop(0)))
        if sum(len(t) for t in self.stored.values()) > self.total:
            oldest = min((t[0], g) for g, t in self.stored.items() if t)
            self.stored[oldest[1]].pop(0)
            out.append(self.keys.history_entry(oldest[1], oldest[0]))
        return out

    def _footprint(self, group: str, job: str, lookup) -> dict:
        """The job's bytes per device on the group's nodes, as their agents report them now."""
        spec = self._load(R.GroupSpec, lookup(self.keys.spec(group)))
        out: dict[str, int] = {}
        for node in (spec.node_names() if spec is not None else []):
            agent = self._load(R.AgentValue, lookup(self.keys.agent(node)))
            per = agent.job_gpus.get(job) if agent is not None and isinstance(agent.job_gpus, dict) else None
            for dev, b in (list(per.items())[:MAX_SWAPS] if isinstance(per, dict) else []):
                if isinstance(b, int) and b > 0:
                    out[f"{node}/{dev}"] = b
        return out

    # -- helpers ------------------------------------------------------------------------------
    def _parts(self, key: bytes) -> tuple[str, ...]:
        try:
            return self.keys.parse(key)
        except (ValueError, UnicodeDecodeError):
            return ()

    @staticmethod
    def _load(cls, kv):
        if kv is None:
            return None
        try:
            return cls.load(kv.value)
        except (ValueError, TypeError):
            return None


class History:
    """The book on a replica: fed while it leads, written by ``run``."""

    def __init__(self, keys: Keys, kvs: Callable[[], Mapping[bytes, object]],
                 lookup: Callable[[bytes], object | None], flush_s: float = FLUSH_S,
                 book: HistoryBook | None = None):
        self.kvs, self.lookup, self.flush_s = kvs, lookup, flush_s
        self.book = book or HistoryBook(keys)
        self._wake = asyncio.Event()

    def on_batch(self, events: list[WatchEvent], reset: bool, leadership: Leadership | None) -> None:
        if leadership is None:
            return
        try:
            self._on_batch(events, reset, leadership)
        except Exception:  # a record keeper's bug must never stop the mirror that calls it
            log.exception("history_observe_failed")

    def _on_batch(self, events: list[WatchEvent], reset: bool, leadership: Leadership) -> None:
        now = R.now_ms()
        if reset or leadership.epoch != self.book.epoch:
            self.book.reseed(self.kvs(), leadership.epoch, now)
            if not reset:
                self.book.observe(events, self.lookup, now)
        else:
            self.book.observe(events, self.lookup, now)
        if self.book.pending:
            self._wake.set()

    async def run(self, leadership: Callable[[], Leadership | None]) -> None:
        dropped = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            lead = leadership()
            if lead is None or lead.epoch != self.book.epoch:
                # No longer leading: the next leader records from its own start; what this one
                # had not written yet is counted as dropped (and logged below).
                self.book.dropped += len(self.book.pending)
                self.book.pending.clear()
            else:
                for _ in range(MAX_TXNS_PER_FLUSH):
                    if not self.book.pending or not await self._write(lead):
                        break
            if self.book.pending:
                self._wake.set()                      # the rest after the next interval
            if self.book.dropped != dropped:
                log.warning("history_records_dropped", dropped=self.book.dropped - dropped,
                            why="more finished holds than writes kept up with")
                dropped = self.book.dropped
            await asyncio.sleep(self.flush_s)         # batch: what ends meanwhile goes in the next round

    async def _write(self, lead: Leadership) -> bool:
        puts, deletes, taken = self.book.take()
        try:
            # Why: store the finished holds (and drop the oldest past the bounds) in one
            # transaction, guarded by this leader's epoch, so a deposed leader writes nothing
            # its successor did not see. The history is not on any handoff path: a failed
            # write is retried at the next interval.
            await lead.txn(success=[*(ops.put(k, v) for k, v in puts), *(ops.delete(k) for k in deletes)])
        except TimesliceError as e:
            self.book.give_back(taken)
            log.warning("history_write_failed", error=str(e), records=len(taken))
            return False
        return True
