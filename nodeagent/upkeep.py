"""Keeping etcd's picture of the node true: the liveness key, drifted statuses, leftovers.

* ``refresh`` (every --refresh-interval, at once after a worker registers or a
  cooperative worker says hello, and after each op): reads every local job's
  processes, rewrites the liveness key when its figures changed, and corrects
  a status whose ``state`` no longer matches the processes (a job that died
  while snapshotted is gone, a job a direct call restored is running).
  Statuses an intent driver is working on are left to it. A job whose state
  cannot be read (a cooperative worker not reconnected since the agent
  started) is listed as unknown, with what the device meter sees of it, and
  its status is left as the last one known.
* ``reconcile`` (at start): a process left LOCKED by an agent that died mid-op
  is unlocked, unless an unanswered intent will finish the op instead, or the
  lock is a freeze the agent made on purpose (a freeze intent it answered, an
  orphan it froze): those outlive the agent.

Writers of the liveness key hold ``lock`` while they compute *and* write it,
so a value computed before an op can never land after the op's own.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from timeslice.common.server import records as R
from timeslice.common.server.etcd.session import Session
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.composite import CompositeBackend
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.config import AgentConfig
from timeslice.nodeagent.exclusion import DeviceExclusion
from timeslice.nodeagent.inventory import Inventory, differs
from timeslice.nodeagent.jobs import LocalJobs, load_status
from timeslice.nodeagent.metrics import Metrics
from timeslice.nodeagent.picture import Picture, take
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.reporter import Reporter

log = structlog.get_logger(__name__)


class Upkeep:
    def __init__(self, cfg: AgentConfig, backend: CompositeBackend, metrics: Metrics, jobs: LocalJobs,
                 channel: ChannelServer, processes: JobProcesses, inventory: Inventory, reporter: Reporter,
                 exclusion: DeviceExclusion, session: Callable[[], Session], renew: Callable[[], Awaitable[None]],
                 busy: Callable[[str], bool], unanswered: Callable[[str], bool]):
        """``session()``: the agent's lease now, ``renew()`` replaces a lost one; ``busy(job)``: an op or
        an intent driver works on ``job`` (its status is theirs to write); ``unanswered(job)``: the
        job has an intent nobody answered yet (an op will finish what a dead agent left half-done)."""
        self.cfg, self.node, self.backend, self.metrics = cfg, cfg.node, backend, metrics
        self.jobs, self.channel, self.processes, self.inventory = jobs, channel, processes, inventory
        self.reporter, self.exclusion, self.session, self.renew = reporter, exclusion, session, renew
        self.busy, self.unanswered = busy, unanswered
        self.endpoint = ""                  # the agent's direct API, named in the liveness key (set at start)
        self._warned: dict[str, int] = {}      # job -> the parking (status updated_ms) already warned of
        self.lock = asyncio.Lock()          # one writer of the liveness key at a time
        self.soon = asyncio.Event()         # refresh now rather than at the next tick
        self.force_put = False              # rewrite the key even if unchanged (new lease)
        self.begun = self.finished = 0      # refreshes started / the last one finished (by number)
        self._after = asyncio.Lock()        # callers of refresh_after: one drives, the rest ride along

    def lease_renewed(self) -> None:
        """The agent's lease was replaced: the liveness key must move to the new one, now."""
        self.force_put = True
        self.soon.set()

    async def pictures(self) -> dict[str, Picture]:
        local = self.jobs.local()
        # A job that let its registrations go itself (it closed its session: it is on its way out)
        # keeps its cooperative workers' memory on the device until they exit: still its own.
        for pid, job in self.channel.cooperative_pids().items():
            reg, rem = local.get(job, ([], []))
            if pid not in reg and self.exclusion.let_go(job):
                local[job] = (sorted({*reg, pid}), [p for p in rem if p != pid])

        def work():
            # Only what the job may be acted on for counts as its footprint (nodeagent/attestations.py).
            return {job: take(self.backend, self.processes.trusted(job, reg), rem)
                    for job, (reg, rem) in local.items()}
        return await asyncio.to_thread(work)

    async def agent_value(self, pictures: dict[str, Picture] | None = None) -> R.AgentValue:
        pictures = pictures if pictures is not None else await self.pictures()
        # Every job with memory on the devices is listed, as the leader must count it resident: running,
        # frozen (its memory stays there), paused in part (a further pause frees more), or unknown.
        listed = {j: p for j, p in pictures.items()
                  if p.state in (R.RUNNING, R.FROZEN, R.UNKNOWN) or p.partial}
        resident = {j: p.resident_bytes for j, p in listed.items()}
        # Time on the devices, per job: running or frozen there (a parked job's leftovers do not count).
        self.metrics.duty.note_resident(j for j, b in resident.items()
                                        if b and listed[j].state in (R.RUNNING, R.FROZEN))
        self.metrics.note_residue({j: p.residue_bytes for j, p in pictures.items()
                                   if p.state == R.SNAPSHOTTED and p.residue})
        # Per device, for the leader's per-GPU plan; a job listed with {} has no device
        # context here (a CPU-only pid, a worker registered before CUDA init): not resident.
        # An unknown job the meter cannot place is left out: the leader then assumes its
        # registered footprint on its declared GPUs (or all of them), never "no context".
        where = {j: p.resident_devices for j, p in listed.items()
                 if p.state != R.UNKNOWN or p.resident_devices}
        unknown = sorted(j for j, p in pictures.items() if p.state == R.UNKNOWN)
        value = await asyncio.to_thread(self.inventory.agent_value, self.node, self.endpoint, resident, where, unknown)
        self.metrics.host_free.set(value.host_free_bytes)
        self.metrics.device_free.set(value.device_free_bytes)
        return value

    async def refresh_after(self) -> None:
        """Return once a refresh that began after this call has finished. A burst of callers
        (several workers' growths, a flood) shares one refresh instead of queueing one each."""
        want = self.begun + 1
        async with self._after:
            if self.finished < want:
                await self.refresh()

    async def refresh(self, force: bool = False) -> None:
        async with self.lock:
            self.begun += 1
            number = self.begun
            # First: a job whose session went while on a GPU is frozen *before* the report that
            # drops it from the running jobs, which is what lets the leader grant past it.
            try:
                await self.exclusion.run()
            except Exception as e:  # never stop reporting for it
                log.error("fence_failed", error=str(e)[:300])
            pictures = await self.pictures()
            value = await self.agent_value(pictures)
            if force or self.force_put or differs(self.reporter.last_agent, value):
                self.force_put = False
                await self.reporter.put_agent(value)
            self.finished = number
        self.jobs.prune_adopted({j: {p for p, s in pic.states.items() if s is ProcState.GONE}
                              for j, pic in pictures.items() if j in self.jobs.adopted})
        for job, pic in pictures.items():
            skv = self.jobs.status_kv(job)
            if skv is None or self.busy(job):
                continue
            old = load_status(skv.value)
            new = I.corrected(old, pic) if old is not None else None
            if new is not None and await self.reporter.correct(job, new, skv.mod_revision):
                log.info("status_corrected", job=job, state=new.state, pids=new.pids)
        self.warn_parked(self.jobs.statuses())

    def warn_parked(self, statuses) -> None:
        """Say once per parking when a job has stayed snapshotted past ``parked_warn_s``.

        A parked job with a live session is normal between phases, but a long one is
        where a stray device call outside a hold hides: on the checkpoint backend the
        call blocks until the job acquires again; on the cooperative one it faults.
        """
        now, limit = R.now_ms(), self.cfg.parked_warn_s * 1000
        parked = {st.job: st.updated_ms for st in statuses if st.state == R.SNAPSHOTTED}
        for job in list(self._warned):
            if parked.get(job) != self._warned[job]:
                del self._warned[job]                       # restored (or re-parked): a new parking
        for job, since in parked.items():
            if since and now - since >= limit and self._warned.get(job) != since:
                self._warned[job] = since
                log.warning("job_parked_long", job=job, node=self.node, parked_s=round((now - since) / 1000),
                            hint="the job is snapshotted and has not acquired again; it must not touch the GPU "
                                 "until it does (a stray call blocks on the checkpoint backend, faults on the "
                                 "cooperative one)")

    async def loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.soon.wait(), self.cfg.refresh_interval)
                await asyncio.sleep(0.02)           # coalesce a burst of registrations
            except asyncio.TimeoutError:
                pass
            self.soon.clear()
            try:
                if not self.session().alive:
                    await self.renew()
                await self.refresh()
                self.metrics.etcd_connected.set(1)
                self.channel.prune()                   # exited processes' word is void (pids are reused)
                # the simulator: drop files of exited workers (a no-op on the others)
                await asyncio.to_thread(self.backend.reap)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep refreshing whatever happens
                self.metrics.etcd_connected.set(0)
                log.warning("refresh_failed", error=str(e))

    async def reconcile(self) -> None:
        for job, pic in (await self.pictures()).items():
            locked = [p for p, s in pic.states.items() if s is ProcState.LOCKED and p not in self.exclusion.frozen()]
            if not locked or self.unanswered(job) or I.frozen_by_intent(self.jobs.status(job)):
                continue                    # an op will finish it, or the freeze is deliberate (kept)
            for pid in locked:
                try:
                    await asyncio.to_thread(self.backend.unlock, pid)
                    log.warning("reconcile_unlocked", job=job, pid=pid)
                except Exception as e:
                    log.error("reconcile_unlock_failed", job=job, pid=pid, error=str(e))
