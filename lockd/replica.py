"""One lockd replica: the etcd mirror, the services, and the leader loop, wired together."""
from __future__ import annotations

import asyncio

import structlog

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.election import Leadership
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.etcd.watch import WatchEvent
from timeslice.common.server.keys import Keys
from timeslice.lockd.config import LockdConfig
from timeslice.lockd.groups import Groups
from timeslice.lockd.history import History
from timeslice.lockd.index import StateIndex
from timeslice.lockd.leader import LeaderLoop
from timeslice.lockd.locks import Locks
from timeslice.lockd.metrics import LockdMetrics
from timeslice.lockd.profiles import ProfileService
from timeslice.lockd.sessions import JobSessions
from timeslice.lockd.tenancy import Tenancy
from timeslice.lockd.traces import HandoffTraces
from timeslice.lockd.waiters import Waiters
from timeslice.lockd.watches import Watches
from timeslice.lockd.workers import WorkerRegistry

log = structlog.get_logger(__name__)


class Replica:
    def __init__(self, config: LockdConfig, metrics: LockdMetrics | None = None, client: EtcdClient | None = None):
        self.config = config
        self.metrics = metrics or LockdMetrics()
        self.client = client or EtcdClient(config.etcd)
        self.keys = Keys(config.prefix)
        self.index = StateIndex(self.keys)
        # Deleted groups' queue_depth series go at the next scrape.
        self.metrics.queue_depth.live_groups = lambda: list(self.index.groups)
        self.reflector = Reflector(self.client, self.keys.root())
        self.waiters = Waiters(self.keys)
        self.sessions = JobSessions(self.client, self.keys, self.index, config.replica_id, config.sessions,
                                 seen=lambda rev: self.reflector.wait_revision(rev, timeout=5))
        self.locks = Locks(self.client, self.keys, self.index, self.reflector, self.waiters, config.replica_id,
                           config.policy, leadership=self._current_leadership,
                           on_direct_grant=self._direct_grant)
        self.groups = Groups(self.client, self.keys, self.index, max_groups=config.max_groups)
        self.workers = WorkerRegistry(self.client, self.keys, self.index, config.max_workers_per_job)
        self.watches = Watches(config.callers.max_watches, config.callers.max_watches_per_caller)
        self.tenancy = Tenancy(self.client, self.keys, self.index, enabled=config.callers.tenants_file is not None)
        # Job profiles, read off the history of holds in the mirror (lockd/profiles.py).
        self.profile_view = ProfileService(self.keys, self.index, self.reflector, self.groups, config.profile_phases)
        self.leader = LeaderLoop(self.client, self.keys, self.index, self.reflector, config.replica_id,
                                 config.election, config.policy, self.metrics)
        # The leader exports each live job's busy and wait shares, from the same profiles.
        self.metrics.job_fractions.source = lambda: (self.profile_view.fractions()
                                                     if self.leader.leadership is not None else {})
        # Finished holds, recorded by the leader for `timeslice report` (lockd/history.py).
        self.history = History(self.keys, lambda: self.reflector.kvs, self.reflector.get)
        # The leader's spans of each traced handoff, from the same events (opt-in: lockd/traces.py).
        self.traces = HandoffTraces(self.keys, self.index, config.replica_id)
        self.reflector.add_listener(self._on_batch)
        self._tasks: list[asyncio.Task] = []
        self._ops_seen: set[tuple[bytes, int]] = set()

    def _on_batch(self, events: list[WatchEvent], reset: bool) -> None:
        # Order matters: the index first, so waiters and the scheduler see the new state.
        if reset:
            self.index.rebuild(self.reflector.kvs)
        touched = self.index.apply(events) if not reset else set()
        self.waiters.on_batch(events, reset)
        sched = self.leader.scheduler
        if sched is not None:
            sched.mark_all() if reset else sched.on_touched(touched)
            self._observe_agent_ops(events)
            self.history.on_batch(events, reset, self.leader.leadership)
            self.traces.on_batch(events, not reset)

    def _current_leadership(self) -> Leadership | None:
        """The leadership that fences a direct handoff: ours when we lead, else the current
        leader's as this replica's mirror shows it (the guard fails if that is stale)."""
        if self.leader.leadership is not None:
            return self.leader.leadership
        head = self.index.leader_candidate()
        # Another replica's leadership, seen through the mirror: only its guard() is used (no session).
        return Leadership(head.key, head.create_revision, None) if head else None  # type: ignore[arg-type]

    def _direct_grant(self, group: str, g, shared: bool = False) -> None:
        sched = self.leader.scheduler
        if sched is not None:
            sched.record_grant(group, g.job, g.token, g.restored, g.elided, g.bytes_moved, direct=True,
                               shared=shared, backfilled=g.backfilled)
        else:
            self.metrics.grants.inc()
            self.metrics.grant_kinds.labels("shared" if shared else "exclusive").inc()
            log.info("grant", group=group, job=g.job, token=g.token, epoch=g.leader_epoch, restored=g.restored,
                     elided=g.elided, bytes_moved=g.bytes_moved, direct=True, replica=self.config.replica_id,
                     shared=shared, backfilled=g.backfilled)

    def _observe_agent_ops(self, events: list[WatchEvent]) -> None:
        # The leader records how long agents took, once per answered intent (agents
        # also re-put statuses for corrections and direct ops: those are not counted).
        for ev in events:
            if not ev.is_put or not self.keys.is_status(ev.kv.key):
                continue
            try:
                st = R.StatusValue.load(ev.kv.value)
            except (ValueError, TypeError):
                continue
            seen = (ev.kv.key, st.intent_revision)
            if st.outcome != R.OK or not st.op or st.intent_revision <= 0 or seen in self._ops_seen:
                continue
            self._ops_seen.add(seen)
            if len(self._ops_seen) > 10000:
                self._ops_seen.clear()
            self.metrics.agent_op.labels(st.op).observe(st.elapsed_ms / 1000)

    async def start(self, sync_timeout: float = 30.0) -> None:
        self.reflector.start()
        await asyncio.wait_for(self.reflector.synced.wait(), sync_timeout)
        self._tasks.append(asyncio.create_task(self.leader.run(), name="leader"))
        self._tasks.append(asyncio.create_task(self.history.run(lambda: self.leader.leadership), name="history"))
        log.info("replica_started", replica=self.config.replica_id, prefix=self.config.prefix)

    async def etcd_healthy(self, timeout: float = 2.0) -> bool:
        try:
            await self.client.range(ops.range_req(self.keys.root(), count_only=True), timeout=timeout)
            return True
        except Exception:
            return False

    @property
    def epoch(self) -> int:
        """The current leader's epoch as this replica knows it (0: none known)."""
        head = self.index.leader_candidate()
        return head.create_revision if head else 0

    async def stop(self) -> None:
        """Resign first (so the next leader starts at once), then stop everything."""
        try:
            await asyncio.wait_for(self.leader.resign(), 5)
        except Exception as e:
            log.warning("resign_failed", error=str(e))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.reflector.stop()
        await self.client.close()
