"""Exclusion at the device, the agent's side: freeze and thaw the processes of jobs that lost or
left their sessions while on a GPU (decided sans-IO in nodeagent/orphans.py).

* A job whose session *expired* while its processes live on a device (a holder paused past its
  lease) is frozen (process lock) before the agent's next report, which is what lets the leader
  grant past it (lockd.plan ``unfenced``); its job registering the processes again thaws them.
* A job frozen on purpose by a freeze intent (a strict group's elided handoff) that unregisters
  or closes its session is thawed: on the real driver a process exiting with its context locked
  would wait on the lock. Its expired session keeps it frozen, like any orphan's.

Called by every refresh (``Upkeep.refresh``), before the report; device calls run in a thread.
Whom it froze is kept on disk (``orphans_path``): a restarted agent still knows.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog

from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.nodeagent import intents as I
from timeslice.nodeagent import orphans as O
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.composite import CompositeBackend
from timeslice.nodeagent.jobs import LocalJobs
from timeslice.nodeagent.processes import JobProcesses

log = structlog.get_logger(__name__)


class DeviceExclusion:
    def __init__(self, backend: CompositeBackend, keys: Keys, jobs: LocalJobs, jobs_mirror: Reflector,
                 processes: JobProcesses, orphans_path: Path, busy: Callable[[str], bool]):
        """``busy(job)``: an op or an intent driver works on ``job`` now (its thaw waits a refresh:
        ``Runner.busy``)."""
        self.backend, self.keys, self.jobs, self.jobs_mirror = backend, keys, jobs, jobs_mirror
        self.processes, self.busy = processes, busy
        self.orphans_path = orphans_path
        self.orphans = O.Orphans.load(orphans_path)         # sessions gone, processes on a GPU

    def frozen(self) -> dict[int, str]:
        """pid -> job, for the orphans this agent (or the one before it) froze and has not thawed."""
        return self.orphans.frozen

    def let_go(self, job: str) -> bool:
        """True if ``job`` dropped its registrations itself: its session lives on, or CloseSession
        left its marker. Only an expired session's on-device processes are frozen."""
        return (self.jobs_mirror.get(self.keys.session(job)) is not None
                or self.jobs_mirror.get(self.keys.closed(job)) is not None)

    async def run(self) -> None:
        """One pass (see the module's docstring). A thaw waits for no op: a job with an op in flight
        is thawed at a later refresh (the op's own status write refreshes through here, holding the
        job's op lock)."""
        listed = {pid: job for pid, (job, _) in self.jobs.local_workers().items()}
        regs = {pid: job for pid, job in listed.items() if self.processes.trusted(job, [pid])}
        backend, base, orphans = self.backend, self.backend.base, self.orphans

        def state(pid: int) -> str:
            st = backend.get_state(pid)
            if st is ProcState.GONE:
                return O.GONE
            on = st is ProcState.RUNNING and (backend.device_bytes(pid) or 0) > 0
            return O.ON_DEVICE if on else O.OFF_DEVICE

        held = {st.job: st.pids for st in self.jobs.statuses() if I.frozen_by_intent(st)}
        leaving = {p: j for p, j in O.Orphans.leaving(held, listed, self.let_go).items()
                   if p not in orphans.frozen}

        def work() -> None:
            for pid, job in leaving.items():
                if job not in busy and base.get_state(pid) is ProcState.LOCKED:
                    try:
                        base.unlock(pid)
                        log.info("frozen_job_left", job=job, pid=pid, why="unregistered or session closed: "
                                 "its exit must not wait on the lock")
                    except Exception as e:  # gone meanwhile: reported, not fatal
                        log.info("frozen_job_left_unlock_failed", job=job, pid=pid, error=str(e)[:300])
            step = orphans.step(regs, state, self.let_go)
            frozen, thawed = {}, {}
            for pid, job in step.freeze.items():
                try:
                    base.lock(pid, 2_000)
                    frozen[pid] = job
                    log.warning("orphan_frozen", job=job, pid=pid,
                                why="its session expired while it was on a GPU: it runs nothing there until "
                                    "its job registers it again")
                except Exception as e:  # gone meanwhile, or no context: reported, not fatal
                    log.error("orphan_freeze_failed", job=job, pid=pid, error=str(e)[:300])
            for pid, job in step.thaw.items():
                if job in busy:
                    continue                              # next refresh
                try:
                    if base.get_state(pid) is ProcState.LOCKED:
                        base.unlock(pid)
                    thawed[pid] = job
                    log.info("orphan_thawed", job=job, pid=pid)
                except Exception as e:
                    log.error("orphan_thaw_failed", job=job, pid=pid, error=str(e)[:300])
            orphans.record(frozen, thawed)
            if frozen or thawed or step.forgotten:
                orphans.save(self.orphans_path)         # a restarted agent still knows whom it froze

        busy = {job for job in set(regs.values()) if self.busy(job)}
        await asyncio.to_thread(work)
