"""The intent loop: one driver per job runs the job's current intent, then answers it in etcd.

Level-triggered: a node mirror event for a job's intent (or a resync) kicks the job's driver,
which runs the *current* intent unless the job's status already answers it (``pending``), so
the newest intent per job wins, a repeated event is harmless, and a restarted agent simply
runs whatever is still unanswered. A driver runs its job's intents one at a time, holding the
job's op lock (``Runner.lock``, shared with the direct API); different jobs run concurrently.
An intent that fails for etcd or a bug is retried with a growing delay; a process's failure
is the job's report, never a retry.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from timeslice.common.server import records as R
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.jobs import LocalJobs, load_status
from timeslice.nodeagent.metrics import Metrics
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.reconnects import Reconnects
from timeslice.nodeagent.reporter import Reporter
from timeslice.nodeagent.runner import Runner
from timeslice.nodeagent.tokens import TokenBook
from timeslice.nodeagent.traces import OpSpans
from timeslice.nodeagent.upkeep import Upkeep

log = structlog.get_logger(__name__)


class IntentDriver:
    def __init__(self, jobs: LocalJobs, processes: JobProcesses, reconnects: Reconnects, tokens: TokenBook,
                 runner: Runner, upkeep: Upkeep, reporter: Reporter, metrics: Metrics, spans: OpSpans,
                 stopping: asyncio.Event):
        """``stopping``: set when the agent stops; no driver starts and none takes another intent."""
        self.jobs, self.processes, self.reconnects, self.tokens = jobs, processes, reconnects, tokens
        self.runner, self.upkeep, self.reporter, self.metrics = runner, upkeep, reporter, metrics
        self.spans, self.stopping = spans, stopping
        self._drivers: dict[str, asyncio.Task] = {}
        self._answered: dict[str, int] = {}          # job -> intent revision answered by this process

    # --- triggers (the node mirror's listener: synchronous, called for every batch) -----
    def on_node_batch(self, events, reset: bool) -> None:
        if reset:
            self.kick_all()
            return
        for ev in events:
            job = self.jobs.intent_job(ev.kv.key)
            if job is not None and ev.is_put:
                self.kick(job)

    def kick_all(self) -> None:
        for job in self.jobs.intent_jobs():
            self.kick(job)

    def kick(self, job: str) -> None:
        if not self.stopping.is_set() and job not in self._drivers:
            self._drivers[job] = asyncio.create_task(self._drive(job), name=f"intent-{job}")
            self.runner.driven.add(job)                 # its status is the driver's to write from now

    # --- the drivers ---------------------------------------------------------------------
    def tasks(self) -> list[asyncio.Task]:
        """The drivers running now."""
        return list(self._drivers.values())

    async def settle(self, grace: float) -> None:
        """Wait (up to ``grace`` s) for the drivers running now to finish their intents."""
        if self._drivers:
            await asyncio.wait(list(self._drivers.values()), timeout=grace)

    def pending(self, job: str) -> I.Intent | None:
        """The job's current intent if nobody has answered it yet."""
        kv = self.jobs.intent_kv(job)
        if kv is None:
            return None
        intent = I.Intent.from_kv(job, kv)
        if self._answered.get(job) == intent.revision or I.answered(intent, self.jobs.status(job)):
            return None
        return intent

    async def _drive(self, job: str) -> None:
        delay = 0.1
        try:
            while not self.stopping.is_set():
                intent = self.pending(job)
                if intent is None:
                    return              # no await since the check: a new event starts a new driver
                try:
                    await self._handle(intent)
                    delay = 0.1
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # etcd down, a bug: retry the intent later
                    log.exception("intent_retry", **intent.log_ctx(), error=str(e))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            self._drivers.pop(job, None)
            self.runner.driven.discard(job)

    async def _handle(self, intent: I.Intent) -> None:
        ctx = intent.log_ctx()
        # The backend's own log lines (in worker threads) carry the job and token too.
        with structlog.contextvars.bound_contextvars(job=intent.job, token=intent.token, op=intent.op):
            async with self.runner.lock(intent.job):
                await self._handle_locked(intent, ctx)

    async def _handle_locked(self, intent: I.Intent, ctx: dict) -> None:
        regs = await self.processes.registrations(intent.job)
        stale = self.tokens.stale(intent.group, intent.token) if intent.value else ""
        if not stale and not intent.error:
            # Registered pids nobody has attested to this agent yet, right after its start: each is
            # waited for (bounded) to attest or exit, never acted on or taken for absent meanwhile.
            found = await self.processes.candidates(intent.job, regs)
            await self.reconnects.settle(lambda: self.processes.settling(intent.job, found))
        registered, remembered = await self.processes.pids(intent.job, regs)
        # Cooperative workers with no channel (not reconnected since this agent started, or closing):
        # their state is theirs to say. Wait for each to come back or exit (bounded), then look.
        coop = self.processes.cooperative([*registered, *remembered])
        away = "" if stale or intent.error or not coop else await self.reconnects.wait_all(coop, intent.job)
        pic = await self.runner.picture(registered, remembered)
        d = I.decide(intent, pic, stale, self.tokens.highest(intent.group) if stale else 0,
                     I.checkpoint_refusal(regs), away)
        if d.kind != I.RUN:
            st = I.status(intent, pic.state, d.outcome, device_bytes=pic.device_bytes, gpu_bytes=pic.gpu_bytes,
                          token=d.fence,
                          error="" if d.outcome == R.OK else d.reason, pids=pic.live_pids)
            if await self._answer(intent, st):
                self.metrics.ops.labels(intent.op or "?", d.outcome, "intent").inc()
                say = log.warning if d.kind == I.REFUSE else log.info
                say("intent_refused" if d.kind == I.REFUSE else "intent_reported", **ctx,
                    outcome=d.outcome, state=pic.state, reason=d.reason)
            return
        await asyncio.to_thread(self.tokens.note, intent.group, intent.token)
        # A freeze or thaw moves nothing and takes a few ms: no in-progress report (an agent that dies
        # mid-way runs the unanswered intent again; a lock or unlock done already is "already"), and
        # no refreshed agent key with the answer (the device figures do not change). Each saves a
        # write in the elided handoff of a strict group, which waits for these answers.
        moves = intent.op in (R.SNAPSHOT, R.RESTORE)
        skv = self.jobs.status_kv(intent.job)
        before = I.moved_before(intent, load_status(skv.value) if skv is not None else None)
        if moves and not await self._answer(intent, I.in_progress(intent, pic), refresh=False):
            return
        log.info("op_started", **ctx, pids=pic.live_pids, states=pic.describe())
        assert intent.value is not None                   # decide() runs only a readable intent
        t0_ns = time.time_ns()
        rr = await self.runner.run(intent.op, intent.job, pic.live_pids, "intent",
                                   isolation=intent.value.isolation, need_bytes=intent.value.need_bytes)
        st = I.final(intent, rr.result, rr.after, rr.elapsed_ms, rr.rollback)
        if before:
            st = R.StatusValue(**{**st.__dict__, "bytes": st.bytes + before})
        rev = await self._answer(intent, st, refresh=moves)
        # Opt-in spans of the op, per process (nodeagent/traces.py), after the answer: never in its way.
        await self.spans.record(intent, pic, rr, t0_ns)
        say = {R.FAILED: log.error, R.REFUSED: log.warning}.get(st.outcome, log.info)
        say("op_done", **ctx, outcome=st.outcome, state=st.state, bytes=st.bytes,
            device_bytes=st.device_bytes, elapsed_ms=st.elapsed_ms, error=st.error, written=bool(rev))

    async def _answer(self, intent: I.Intent, st: R.StatusValue, refresh: bool = True) -> int:
        """Write ``st`` for ``intent`` (with the refreshed agent key if ``refresh``); 0 if superseded."""
        if not refresh:
            rev = await self.reporter.answer(intent, st)
        else:
            async with self.upkeep.lock:
                agent = await self.upkeep.agent_value()
                rev = await self.reporter.answer(intent, st, agent)
        if rev and st.outcome:
            self._answered[intent.job] = intent.revision
        if not rev:
            self.metrics.superseded.inc()
            # Let the mirror catch up with the intent that replaced this one
            # before looking again, or the driver would chase the old one.
            try:
                await self.jobs.seen(self.reporter.newer_revision, timeout=5)
            except asyncio.TimeoutError:
                pass
        return rev
