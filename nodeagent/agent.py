"""The node agent, wired: intents in, checkpoint ops out, revisioned statuses back.

This module builds the agent's rooms, each taking its collaborators in its
constructor, starts and stops them in order, and answers the node-local
channel's callbacks (a worker attested, back, gone or grown). The work is in
the rooms: the intent loop in ``nodeagent.driver``, which processes are a
job's in ``nodeagent.processes``, the liveness key and drifted statuses in
``nodeagent.upkeep``, freezing orphans in ``nodeagent.exclusion``, every etcd
write in ``nodeagent.reporter``.

Two mirrors (``Reflector``: read at revision R, watch from R+1, re-read on
compaction) keep the agent's view of etcd: ``nodes/<node>/`` (its intents and
statuses) and ``jobs/`` (worker registrations, to know each job's pids here).

Nothing the agent remembers matters across a restart: etcd holds the intents
and statuses (with the fencing tokens), the processes hold their own
checkpoint state, and ``start`` rebuilds everything from those two.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from timeslice.common import frames as F
from timeslice.common.channel import default_socket_path
from timeslice.common.errors import ConfigError
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys
from timeslice.nodeagent.attestations import Attestations, WorkerAuth
from timeslice.nodeagent.backends import pick_backend
from timeslice.nodeagent.backends.base import Backend
from timeslice.nodeagent.backends.composite import CompositeBackend
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.config import AgentConfig
from timeslice.nodeagent.driver import IntentDriver
from timeslice.nodeagent.exclusion import DeviceExclusion
from timeslice.nodeagent.hostmem import HostMemory
from timeslice.nodeagent.inventory import Inventory
from timeslice.nodeagent.jobs import LocalJobs
from timeslice.nodeagent.lease import AgentLease
from timeslice.nodeagent.metrics import Metrics
from timeslice.nodeagent.nodelock import NodeLock
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.reconnects import Reconnects
from timeslice.nodeagent.reporter import Reporter
from timeslice.nodeagent.room import RoomMaker
from timeslice.nodeagent.runner import Runner
from timeslice.nodeagent.swap_routes import SwapRoutes
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
        self.channel = ChannelServer(cfg.channel_socket or default_socket_path(cfg.node), cfg.node,
                                     lambda job, secret: self.auth.authorize(job, secret),
                                     self._worker_left, self._worker_back, on_attested=self._worker_attested,
                                     on_state=self._worker_grew, on_ask=self._worker_asks)
        self.reconnects = Reconnects(self.channel, cfg.reconnect_grace_s)
        # Each worker is moved the way it registered: checkpoint, cooperative or app endpoint.
        self.backend = CompositeBackend(backend or make_backend(cfg), lambda pid: self.swappers.resolve(pid),
                                        cfg.swap_deadline_s, cfg.freeze_parked, cfg.lock_timeout_ms)
        # Pinned backups being reserved count against free host memory from the start.
        self.host = HostMemory(reserve_bytes=cfg.host_reserve_bytes, pending=self.channel.pending_host_bytes)
        self.inventory = Inventory(self.backend, self.host)
        self.runner = Runner(self.backend, self.host, cfg.lock_timeout_ms, self.metrics)
        self.client = EtcdClient(cfg.etcd)
        # Everything that must vanish with the agent is leased to this one session.
        self.lease = AgentLease(self.client, cfg.session, lambda: self.upkeep.lease_renewed())
        self.node_mirror = Reflector(self.client, self.keys.node(self.node))
        self.jobs_mirror = Reflector(self.client, self.keys.jobs())
        self.jobs = LocalJobs(self.keys, self.node, self.node_mirror, self.jobs_mirror)
        self.swappers = SwapRoutes(self.jobs, self.channel, lambda: self.backend.base, self.reconnects,
                                 cfg.app_drain_s or None, cfg.app_drain_expired)
        # Who may open the channel for a job: the holder of its session secret.
        self.auth = WorkerAuth(self.client, self.keys, self.jobs)
        self.processes = JobProcesses(self.client, self.keys, self.node, self.jobs, self.channel, self.swappers,
                                      cfg.require_attestation)
        # Who attested which pid, and which pids are the system's: told to lockd through etcd.
        self.attestations = Attestations(self.client, self.keys, self.node, self.lease.lease_id)
        self.reporter = Reporter(self.client, self.keys, self.node, self.lease.lease_id, self.lease.renew)
        self.endpoint = ""
        self.stopping = False
        self._tasks: list[asyncio.Task] = []
        # Sessions gone, processes on a GPU: frozen at the device, remembered on disk.
        self.exclusion = DeviceExclusion(self.backend, self.keys, self.jobs, self.jobs_mirror, self.processes,
                                         Path(cfg.state_dir) / f"frozen-{cfg.node}.json", self._busy)
        self.metrics.duty.gpu_utilization = duty_meter(self.backend)
        self.upkeep = Upkeep(cfg, self.backend, self.metrics, self.jobs, self.channel, self.processes, self.inventory,
                             self.reporter, self.exclusion, self.lease.live, self.lease.renew, self._busy,
                             lambda job: self.driver.pending(job) is not None)
        # The intent loop: one driver per job (nodeagent/driver.py).
        # Room for a holder's allocation that did not fit: parked residue moved off its GPU (nodeagent/room.py).
        self.room = RoomMaker(self.node, self.keys, self.client, self.jobs, self.channel, self.processes,
                              self.runner, self.reporter, self.backend, self.upkeep.refresh)
        self.driver = IntentDriver(self.node, self.keys, self.client, self.backend.name, self.jobs, self.node_mirror,
                                   self.processes, self.swappers, self.reconnects, self.tokens, self.runner,
                                   self.upkeep, self.reporter, self.metrics, lambda: self.stopping)

    def _busy(self, job: str) -> bool:
        """An op (intent or direct) or an intent driver works on ``job``: its status is theirs."""
        return self.runner.busy(job) or self.driver.driving(job)

    # --- life cycle ----------------------------------------------------------
    async def start(self, endpoint: str = "", sync_timeout: float = 30.0) -> None:
        self.endpoint = self.upkeep.endpoint = endpoint
        await self.nodelock.acquire()
        session = await self.lease.open()
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
        self.node_mirror.add_listener(self.driver.on_node_batch)
        self.jobs_mirror.add_listener(self._on_jobs_batch)
        self._tasks.append(asyncio.create_task(self.upkeep.loop(), name="agent-refresh"))
        self._tasks.append(asyncio.create_task(self.attestations.loop(self.channel.attested, self.cfg.refresh_interval),
                                               name="agent-attestations"))
        self.driver.kick_all()
        log.info("agent_started", node=self.node, backend=self.backend.name, why=self.backend.why,
                 lease=f"{session.lease_id:x}", tokens=self.tokens.snapshot(), endpoint=endpoint)

    async def stop(self, grace: float = 30.0) -> None:
        """Finish the ops in flight (up to ``grace`` s), then give the lease back."""
        self.stopping = True
        await self.driver.settle(grace)
        tasks = [*self._tasks, *self.driver.tasks()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.channel.stop()
        for m in (self.node_mirror, self.jobs_mirror):
            await m.stop()
        await self.lease.close()                # the liveness key goes with the lease
        self.inventory.close()
        self.backend.close()
        await self.client.close()
        self.nodelock.release()

    # --- cooperative workers ------------------------------------------------------
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

    async def _worker_asks(self, info, msg: dict) -> dict:
        """A worker's request: room inside its hold (nodeagent/room.py), or the admission of a pinned host
        backup before it is made: counted as promised from now (its state frames then say how it goes)."""
        if msg["type"] == F.ROOM:
            return await self.room.answer(info, msg)
        # On the loop, with no await between the check and the count: two workers asking at once never
        # both take the same free memory.
        ok, free, why = self.host.admit_pool(msg["bytes"], info.host_reserving)
        if ok:
            info.host_reserving = msg["bytes"]
            log.info("host_backup_admitted", pid=info.pid, job=info.job, bytes=msg["bytes"], free_bytes=free)
            log.info("host_reservation_started", pid=info.pid, job=info.job, reserving=info.host_reserving,
                     host_bytes=info.host_bytes)
        else:
            log.warning("host_backup_refused", pid=info.pid, job=info.job, bytes=msg["bytes"], free_bytes=free)
        return F.hosted(msg["id"], ok, free, why)

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

    # --- triggers (the jobs mirror's listener: synchronous, called for every batch) -------
    def _on_jobs_batch(self, events, reset: bool) -> None:
        if reset or any(self.jobs.is_local_worker(ev.kv.key) for ev in events):
            self.upkeep.soon.set()
