"""The node agent: intents in, checkpoint ops out, revisioned statuses back.

Two mirrors (``Reflector``: read at revision R, watch from R+1, re-read on
compaction) keep the agent's view of etcd: ``nodes/<node>/`` (its intents and
statuses) and ``jobs/`` (worker registrations, to know each job's pids here).
The intent loop is level-triggered: for a job, the *current* intent is run
unless the job's status already answers it, so the newest intent per job wins,
a repeated event is harmless, and a restarted agent simply runs whatever is
still unanswered. One driver task per job runs its intents one at a time;
different jobs run concurrently.

Nothing the agent remembers matters across a restart: etcd holds the intents
and statuses (with the fencing tokens), the processes hold their own
checkpoint state, and ``start`` rebuilds everything from those two.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from timeslice.channel import default_socket_path
from timeslice.common import records as R
from timeslice.common.errors import ConfigError, TimesliceError
from timeslice.common.etcd import ops
from timeslice.common.etcd.client import EtcdClient
from timeslice.common.etcd.mirror import Reflector
from timeslice.common.etcd.session import Session
from timeslice.common.keys import Keys
from timeslice.nodeagent import intents as I
from timeslice.nodeagent import traces
from timeslice.nodeagent.attestations import Attestations
from timeslice.nodeagent.backends import pick_backend
from timeslice.nodeagent.backends.base import Backend
from timeslice.nodeagent.backends.composite import CompositeBackend
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.config import AgentConfig
from timeslice.nodeagent.fencing import Fence
from timeslice.nodeagent.hostmem import HostMemory
from timeslice.nodeagent.inventory import Inventory
from timeslice.nodeagent.jobs import LocalJobs
from timeslice.nodeagent.metrics import Metrics
from timeslice.nodeagent.nodelock import NodeLock
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.reconnects import Reconnects
from timeslice.nodeagent.reporter import Reporter
from timeslice.nodeagent.runner import Runner
from timeslice.nodeagent.swappers import Swappers
from timeslice.nodeagent.tokens import TokenBook
from timeslice.nodeagent.upkeep import Upkeep

log = structlog.get_logger(__name__)


def make_backend(cfg: AgentConfig) -> Backend:
    opts: dict = {"sim_dir": cfg.sim_dir, "capacity_bytes": cfg.sim_capacity_bytes,
                  "checkpoint_gbps": cfg.sim_checkpoint_gbps, "restore_gbps": cfg.sim_restore_gbps}
    if cfg.backend_name != "sim":
        from timeslice.nodeagent.backends.records import SnapshotRecords
        opts["records"] = SnapshotRecords(cfg.state_dir)
    return pick_backend(cfg.backend_name, **opts)


def duty_meter(backend: CompositeBackend) -> Callable[[], Mapping[str, float] | None]:
    """Duty cycle per GPU, read at scrape time: NVML, or the simulated device's busy fraction."""
    if backend.name == "sim":
        from timeslice.nodeagent.sim.utilization import SimUtilization
        return SimUtilization(backend.dev.root).fraction
    from timeslice.nodeagent.metrics import nvml_utilization
    return nvml_utilization


class Agent:
    def __init__(self, cfg: AgentConfig, backend: Backend | None = None, metrics: Metrics | None = None):
        self.cfg, self.node, self.keys = cfg, cfg.node, Keys(cfg.prefix)
        self.metrics = metrics or Metrics()
        try:
            self.tokens = TokenBook(Path(cfg.state_dir) / f"tokens-{cfg.node}.json")
        except OSError as e:
            raise ConfigError(f"state dir {cfg.state_dir!r} is not usable ({e}); set --state-dir") from e
        self.nodelock = NodeLock(cfg.state_dir, cfg.node)
        self.channel = ChannelServer(cfg.channel_socket or default_socket_path(cfg.node), cfg.node, self._authorize,
                                     self._worker_left, self._worker_back, on_attested=self._worker_attested,
                                     on_state=self._worker_grew)
        self.reconnects = Reconnects(self.channel, cfg.reconnect_grace_s)
        # Each worker is moved the way it registered: checkpoint, cooperative or app endpoint.
        self.backend = CompositeBackend(backend or make_backend(cfg), lambda pid: self.swappers.resolve(pid),
                                        cfg.swap_deadline_s, cfg.freeze_parked, cfg.lock_timeout_ms)
        # Pinned backups being reserved count against free host memory from the start.
        self.host = HostMemory(reserve_bytes=cfg.host_reserve_bytes, pending=self.channel.pending_host_bytes)
        self.inventory = Inventory(self.backend, self.host)
        self.runner = Runner(self.backend, self.host, cfg.lock_timeout_ms, self.metrics)
        self.client = EtcdClient(cfg.etcd)
        self.session: Session | None = None
        self.node_mirror = Reflector(self.client, self.keys.node(self.node))
        self.jobs_mirror = Reflector(self.client, self.keys.jobs())
        self.jobs = LocalJobs(self.keys, self.node, self.node_mirror, self.jobs_mirror)
        self.swappers = Swappers(self.jobs, self.channel, lambda: self.backend.base, self.reconnects,
                                 cfg.app_drain_s or None, cfg.app_drain_expired)
        self.processes = JobProcesses(self.client, self.keys, self.node, self.jobs, self.channel, self.swappers,
                                      cfg.require_attestation)
        # Who attested which pid, and which pids are the system's: told to lockd through etcd.
        self.attestations = Attestations(self.client, self.keys, self.node, lambda: self.live_session().lease_id)
        self.reporter = Reporter(self.client, self.keys, self.node, lambda: self.live_session().lease_id,
                                 self.renew_session)
        self.endpoint = ""
        self.stopping = False
        self._drivers: dict[str, asyncio.Task] = {}
        self._answered: dict[str, int] = {}          # job -> intent revision answered by this process
        self._session_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        # Sessions gone, processes on a GPU: frozen at the device, remembered on disk.
        self.fence = Fence(self.backend, self.keys, self.jobs, self.jobs_mirror, self.processes,
                           Path(cfg.state_dir) / f"frozen-{cfg.node}.json", self._busy)
        self.metrics.duty.gpu_utilization = duty_meter(self.backend)
        self.upkeep = Upkeep(cfg, self.backend, self.metrics, self.jobs, self.channel, self.processes, self.inventory,
                             self.reporter, self.fence, self.live_session, self.renew_session, self._busy,
                             lambda job: self.pending(job) is not None)

    def _busy(self, job: str) -> bool:
        """An op (intent or direct) or an intent driver works on ``job``: its status is theirs."""
        return self.runner.busy(job) or self.driving(job)

    # --- life cycle ----------------------------------------------------------
    async def start(self, endpoint: str = "", sync_timeout: float = 30.0) -> None:
        self.endpoint = self.upkeep.endpoint = endpoint
        await self.nodelock.acquire()
        self.session = await Session(self.client, self.cfg.session).open()
        for m in (self.node_mirror, self.jobs_mirror):
            m.start()
        await asyncio.wait_for(asyncio.gather(self.node_mirror.synced.wait(), self.jobs_mirror.synced.wait()),
                               sync_timeout)
        await self.attestations.publish_protected()   # before any job can register this node's pids
        # After the mirrors: a worker's hello is checked against its job's session key.
        await self.channel.start()
        self.tokens.recover(self.jobs.statuses())
        await self.upkeep.reconcile()
        await self.upkeep.refresh(force=True)
        self.node_mirror.add_listener(self._on_node_batch)
        self.jobs_mirror.add_listener(self._on_jobs_batch)
        self._tasks.append(asyncio.create_task(self.upkeep.loop(), name="agent-refresh"))
        self._tasks.append(asyncio.create_task(self.attestations.loop(self.channel.attested, self.cfg.refresh_interval),
                                               name="agent-attestations"))
        self._kick_all()
        log.info("agent_started", node=self.node, backend=self.backend.name, why=self.backend.why,
                 lease=f"{self.session.lease_id:x}", tokens=self.tokens.snapshot(), endpoint=endpoint)

    async def stop(self, grace: float = 30.0) -> None:
        """Finish the ops in flight (up to ``grace`` s), then give the lease back."""
        self.stopping = True
        if self._drivers:
            await asyncio.wait(list(self._drivers.values()), timeout=grace)
        for t in [*self._tasks, *self._drivers.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._drivers.values(), return_exceptions=True)
        await self.channel.stop()
        for m in (self.node_mirror, self.jobs_mirror):
            await m.stop()
        if self.session is not None:
            try:
                await self.session.close()      # the liveness key goes with the lease
            except TimesliceError as e:
                log.warning("session_close_failed", error=str(e))
        self.inventory.close()
        self.backend.close()
        await self.client.close()
        self.nodelock.release()

    def live_session(self) -> Session:
        """The agent's etcd session (opened by start(); replaced by renew_session())."""
        if self.session is None:
            raise RuntimeError("the agent has not started")
        return self.session

    async def renew_session(self, failed_lease: int | None = None) -> None:
        """Replace a lost lease (etcd unreachable past the TTL, or said so by a write)."""
        async with self._session_lock:
            s = self.live_session()
            if (s.lease_id != failed_lease) if failed_lease is not None else s.alive:
                return                          # renewed already, or nothing wrong
            s.orphan()
            self.session = new = await Session(self.client, self.cfg.session).open()
            log.warning("agent_session_renewed", old=f"{s.lease_id:x}", lease=f"{new.lease_id:x}")
            self.upkeep.lease_renewed()         # the liveness key must move to the new lease

    # --- cooperative workers ------------------------------------------------------
    async def _authorize(self, job: str, secret: str) -> str | None:
        """None if ``secret`` is the session secret of ``job`` (lockd keeps only its SHA-256).

        etcd decides, read fresh: the jobs mirror may lag a session opened a moment ago, or one
        opened again under the same job id by a restarted job (a new secret, which the mirror's
        old digest would refuse while it let the old secret in). Only while etcd cannot be read
        does the mirror's last known digest stand in (a worker reconnecting must not be refused
        over an etcd blip). A worker connects once per process start or agent restart.
        """
        try:
            # Linearizable (the client's default): a serializable read could come from a lagging member.
            r = await self.client.range(ops.range_req(self.keys.session(job)))
            raw = r.kvs[0].value if r.kvs else None
            digest = R.SessionValue.load(raw).secret_sha256 if raw is not None else None
        except TimesliceError as e:
            log.warning("session_read_failed", job=job, error=str(e)[:200], fallback="mirror")
            digest = self.jobs.session_digest(job)
        except Exception:
            digest = None                                # a session key that is not a session
        if digest is None:
            return f"job {job!r} has no live session"
        if not hmac.compare_digest(hashlib.sha256(secret.encode()).hexdigest(), digest):
            return f"wrong session secret for job {job!r}"
        return None

    async def _worker_attested(self, info) -> None:
        """A worker proved its job: say so in etcd before it is welcomed (nodeagent/attestations.py)."""
        await self.attestations.publish(info.pid, info.job, info.start_time)

    def _worker_back(self, info) -> None:
        """A cooperative worker said hello (after an agent restart, its word on what it has paused):
        report its job's picture at once, so the leader stops planning around an unknown worker."""
        self.upkeep.soon.set()

    async def _worker_grew(self, info) -> None:
        """A cooperative worker's memory changed inside its hold and it waits until we report it."""
        await self.upkeep.refresh_after()

    async def _worker_left(self, info) -> None:
        """A cooperative worker closed its channel (exiting, most likely): lift the freeze.

        The freeze only turns a stray device call into a wait; a process on its
        way out must not wait on it (its exit may touch the device). Its paused
        memory stays paused, and a later restore resumes it if it comes back.
        """
        if not info.paused:
            return
        base = self.backend.base

        def unfreeze() -> None:
            from timeslice.nodeagent.backends.base import ProcState
            if base.get_state(info.pid) is ProcState.LOCKED:
                base.unlock(info.pid)
                log.info("cooperative_unfrozen", pid=info.pid, job=info.job, reason="channel closed")
        try:
            async with self.runner.lock(info.job):
                await asyncio.to_thread(unfreeze)
        except Exception as e:  # gone already, most likely
            log.info("cooperative_unfreeze_skipped", pid=info.pid, job=info.job, error=str(e))

    # --- triggers (mirror listeners: synchronous, called for every batch) -------
    def _on_node_batch(self, events, reset: bool) -> None:
        if reset:
            self._kick_all()
            return
        for ev in events:
            job = self.jobs.intent_job(ev.kv.key)
            if job is not None and ev.is_put:
                self._kick(job)

    def _on_jobs_batch(self, events, reset: bool) -> None:
        if reset or any(self.jobs.is_local_worker(ev.kv.key) for ev in events):
            self.upkeep.soon.set()

    def _kick_all(self) -> None:
        for job in self.jobs.intent_jobs():
            self._kick(job)

    def _kick(self, job: str) -> None:
        if not self.stopping and job not in self._drivers:
            self._drivers[job] = asyncio.create_task(self._drive(job), name=f"intent-{job}")

    # --- the intent loop ---------------------------------------------------------
    def driving(self, job: str) -> bool:
        """True while an intent driver works on ``job`` (its status is the driver's to write)."""
        return job in self._drivers

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
            while not self.stopping:
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

    async def _handle(self, intent: I.Intent) -> None:
        ctx = intent.log_ctx()
        # The backend's own log lines (in worker threads) carry the job and token too.
        with structlog.contextvars.bound_contextvars(job=intent.job, token=intent.token, op=intent.op):
            async with self.runner.lock(intent.job):
                await self._handle_locked(intent, ctx)

    async def _handle_locked(self, intent: I.Intent, ctx: dict) -> None:
        regs = await self.processes.registrations(intent.job)
        registered, remembered = await self.processes.pids(intent.job, regs)
        stale = self.tokens.stale(intent.group, intent.token) if intent.value else ""
        # Cooperative workers with no channel (not reconnected since this agent started, or closing):
        # their state is theirs to say. Wait for each to come back or exit (bounded), then look.
        coop = [p for p in [*registered, *remembered] if self.swappers.cooperative(p)]
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
        if moves and not await self._answer(intent, I.in_progress(intent, pic), refresh=False):
            return
        log.info("op_started", **ctx, pids=pic.live_pids, states=pic.describe())
        assert intent.value is not None                   # decide() runs only a readable intent
        t0_ns = time.time_ns()
        rr = await self.runner.run(intent.op, intent.job, pic.live_pids, "intent",
                                   isolation=intent.value.isolation, need_bytes=intent.value.need_bytes)
        st = I.final(intent, rr.result, rr.after, rr.elapsed_ms, rr.rollback)
        rev = await self._answer(intent, st, refresh=moves)
        # Opt-in spans of the op, per process (nodeagent/traces.py), after the answer: never in its way.
        await traces.op_spans(self.client, self.keys, self.node, self.backend.name, intent, pic, rr, t0_ns)
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
                await self.node_mirror.wait_revision(self.reporter.newer_revision, timeout=5)
            except asyncio.TimeoutError:
                pass
        return rev
