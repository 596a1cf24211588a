"""Leadership of a replica: campaign, run the scheduler while leading, step down.

Shaped like client-go's leader elector: timing validated up front, and the
scheduler runs as a task that is cancelled the moment leadership is lost
(leader key deleted, session lost, or a guarded write refused), with
``on_started_leading`` / ``on_stopped_leading`` hooks for metrics and tests.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import structlog

from timeslice.common.errors import TimesliceError
from timeslice.common.server.etcd.backoff import Backoff
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.election import Election, Leadership, wait_deposed
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.etcd.session import Session
from timeslice.common.server.etcd.timing import ElectionTiming
from timeslice.common.server.keys import Keys
from timeslice.lockd.index import StateIndex
from timeslice.lockd.metrics import LockdMetrics
from timeslice.lockd.plan import Policy
from timeslice.lockd.scheduler import Scheduler

log = structlog.get_logger(__name__)


class LeaderLoop:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, reflector: Reflector,
                 replica: str, timing: ElectionTiming, policy: Policy, metrics: LockdMetrics,
                 on_started_leading: Callable[[Leadership], None] | None = None,
                 on_stopped_leading: Callable[[str], None] | None = None):
        self.client, self.keys, self.index, self.reflector = client, keys, index, reflector
        self.replica, self.timing, self.policy, self.metrics = replica, timing, policy, metrics
        self.on_started_leading, self.on_stopped_leading = on_started_leading, on_stopped_leading
        self.leadership: Leadership | None = None
        self.scheduler: Scheduler | None = None
        self._election: Election | None = None
        self._session: Session | None = None
        self._stopping = False

    @property
    def epoch(self) -> int:
        return self.leadership.epoch if self.leadership else 0

    async def run(self) -> None:
        # Jittered, capped by the retry period: replicas that failed together (etcd
        # lost its leader under all of them) do not campaign again in lockstep.
        backoff = Backoff(min(0.05, self.timing.retry_period), self.timing.retry_period)
        while not self._stopping:
            try:
                await self._term()
                backoff.reset()               # a term was served: start from the shortest wait
            except asyncio.CancelledError:
                raise
            except TimesliceError as e:
                log.warning("campaign_failed", replica=self.replica, error=str(e))
            await asyncio.sleep(backoff.next())

    async def _term(self) -> None:
        session = Session(self.client, self.timing.session(), renew_deadline=self.timing.renew_deadline)
        await session.open()
        self._session = session
        try:
            self._election = Election(session, self.keys.election(),
                                      json.dumps({"replica": self.replica}).encode())
            lead = await self._election.campaign()
            self.leadership = lead
            await self.reflector.synced.wait()
            sched = Scheduler(lead, self.keys, self.index, self.reflector, self.policy, self.metrics)
            self.scheduler = sched
            self.metrics.leader_changes.inc()
            self.metrics.is_leader.set(1)
            log.info("leading", replica=self.replica, epoch=lead.epoch)
            if self.on_started_leading:
                self.on_started_leading(lead)
            run = asyncio.create_task(sched.run())
            deposed = asyncio.create_task(wait_deposed(lead))
            fenced = asyncio.create_task(sched.deposed.wait())
            try:
                done, _ = await asyncio.wait({run, deposed, fenced}, return_when=asyncio.FIRST_COMPLETED)
                reason = deposed.result() if deposed in done else (sched.deposed_reason or "scheduler stopped")
            finally:
                for t in (run, deposed, fenced):
                    t.cancel()
                self.scheduler = None
                self.leadership = None
                self.metrics.is_leader.set(0)
            log.warning("stopped_leading", replica=self.replica, epoch=lead.epoch, reason=reason)
            if self.on_stopped_leading:
                self.on_stopped_leading(reason)
        finally:
            self._session = None
            if session.alive:
                try:
                    await session.close()    # revoke: our candidacy vanishes at once
                except TimesliceError:
                    session.orphan()

    async def resign(self) -> None:
        """Step down now (graceful shutdown): the next replica leads without waiting a TTL."""
        self._stopping = True
        if self.scheduler is not None:
            self.scheduler.deposed.set()
        if self._election is not None:
            await self._election.resign()
        if self._session is not None and self._session.alive:
            try:
                await self._session.close()
            except TimesliceError:
                pass
