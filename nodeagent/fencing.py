"""Exclusion at the device, the agent's side: freeze and thaw the processes of jobs that lost or
left their sessions while on a GPU (decided sans-IO in nodeagent/orphans.py).

* A job whose session *expired* while its processes live on a device (a holder paused past its
  lease) is frozen (process lock) before the agent's next report, which is what lets the leader
  grant past it (lockd.plan ``unfenced``); its job registering the processes again thaws them.
* A job frozen on purpose by a freeze intent (a strict group's elided handoff) that unregisters
  or closes its session is thawed: on the real driver a process exiting with its context locked
  would wait on the lock. Its expired session keeps it frozen, like any orphan's.

Called by every refresh (``Upkeep.refresh``), before the report; device calls run in a thread.
"""
from __future__ import annotations

import asyncio
from functools import partial

import structlog

from timeslice.nodeagent import intents as I
from timeslice.nodeagent import orphans as O
from timeslice.nodeagent.backends.base import ProcState

log = structlog.get_logger(__name__)


def let_go(agent, job: str) -> bool:
    """True if ``job`` dropped its registrations itself: its session lives on, or CloseSession
    left its marker. Only an expired session's on-device processes are frozen."""
    return (agent.jobs_mirror.get(agent.keys.session(job)) is not None
            or agent.jobs_mirror.get(agent.keys.closed(job)) is not None)


async def fence(agent) -> None:
    """One pass (see the module's docstring). A thaw waits for no op: a job with an op in flight
    is thawed at a later refresh (the op's own status write refreshes through here, holding the
    job's op lock)."""
    listed = {pid: job for pid, (job, _) in agent.jobs.local_workers().items()}
    regs = {pid: job for pid, job in listed.items() if agent.trusted_pids(job, [pid])}
    base = agent.backend.base

    def state(pid: int) -> str:
        st = agent.backend.get_state(pid)
        if st is ProcState.GONE:
            return O.GONE
        on = st is ProcState.RUNNING and (agent.backend.device_bytes(pid) or 0) > 0
        return O.ON_DEVICE if on else O.OFF_DEVICE

    held = {st.job: st.pids for st in agent.jobs.statuses() if I.frozen_by_intent(st)}
    leaving = {p: j for p, j in O.Orphans.leaving(held, listed, partial(let_go, agent)).items()
               if p not in agent.orphans.frozen}

    def work() -> None:
        for pid, job in leaving.items():
            if job not in busy and base.get_state(pid) is ProcState.LOCKED:
                try:
                    base.unlock(pid)
                    log.info("frozen_job_left", job=job, pid=pid, why="unregistered or session closed: "
                             "its exit must not wait on the lock")
                except Exception as e:  # gone meanwhile: reported, not fatal
                    log.info("frozen_job_left_unlock_failed", job=job, pid=pid, error=str(e)[:300])
        step = agent.orphans.step(regs, state, partial(let_go, agent))
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
        agent.orphans.record(frozen, thawed)
        if frozen or thawed or step.forgotten:
            agent.orphans.save(agent._orphans_path)     # a restarted agent still knows whom it froze

    busy = {job for job in set(regs.values()) if agent.runner.busy(job) or agent.driving(job)}
    await asyncio.to_thread(work)
