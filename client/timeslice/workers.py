"""The job's worker processes: register them with lockd, attest them to the node agent, cooperate.

A node agent acts only on processes a job registered, and (``--require-attestation``)
only on those that proved, over its node-local channel, that they are the job's:
the agent trusts the pid the kernel gives it, never one a caller names. So
``register_worker`` opens (once per process) an attest-only channel, and
``cooperate`` opens the channel a cooperative worker serves pause/resume on
(``timeslice.cooperative``, its own daemon thread, the same for both faces).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from timeslice.common import swaps
from timeslice.core import ClientCore
from timeslice.logs import get_logger
from timeslice.model import Worker
from timeslice.retry import Call
from timeslice.session import Sessions
from timeslice.transport import Transport
from timeslice.usercode import UserCode

if TYPE_CHECKING:
    from timeslice.cooperative import CooperativeWorker

log = get_logger(__name__)

YIELD_SYNC_TIMEOUT_S = 2.0   # how long a Yield waits for the agent's fresh report (one refresh: ms)



def never_checkpoint(memory) -> bool:
    """A cooperative memory whose process the driver checkpoint must never take (``checkpoint_safe =
    False``: JaxMemory) registers as a worker whose context is not checkpointed, which is what
    ``collective`` tells lockd (no residue moved by checkpoint) and the node agent."""
    return not getattr(memory, "checkpoint_safe", True)

class Workers:
    """The job's registered workers, this process's attestation and its cooperative channels."""

    def __init__(self, core: ClientCore, transport: Transport, user: UserCode, sessions: Sessions):
        self.core, self.transport, self.user, self.sessions = core, transport, user, sessions
        self._cooperative: list[CooperativeWorker] = []     # channels opened by cooperate()
        self._attestation: CooperativeWorker | None = None  # this process's attest-only channel

    async def register_worker(self, pid: int | None = None, node: str | None = None, device_bytes: int = 0, *,
                              swap: str = "", gpus=(), endpoint: str = "", tags=None,
                              collective: bool = False) -> Worker:
        """Tell the node agents that process ``pid`` (default: this one) on ``node``
        (default: $TIMESLICE_NODE_NAME, else the host name) holds this job's device memory.

        ``swap`` says how the agent moves it: "checkpoint" (default, CUDA checkpoint of the
        whole process), "cooperative" (the process pauses itself; see ``timeslice.cooperative``),
        "vllm"/"sglang" (the server's HTTP API at ``endpoint``). ``gpus``: the node's GPU indexes
        it uses. ``tags``: region -> "offload"|"discard". ``collective``: it uses CUDA IPC/NCCL p2p,
        so its context must never be checkpointed."""
        core = self.core
        await self.sessions.ensure()
        if swap != swaps.COOPERATIVE:
            from timeslice.config import node_name
            where = node or node_name()
            seen = await self.user.blocking(self.attest_worker, where)
            if pid is None and seen:
                pid = seen                    # the pid as the agent sees it (pid namespaces differ)
            elif seen and pid != seen:
                # Another process (a rank this one started): the agent records it as this job's first, so
                # that no other job can register it before us (lockd asks etcd for the agent's word).
                why = await self.user.blocking(self._vouch, where, pid)
                if why:
                    log.warning("worker_not_vouched", job=core.job_id, node=where, pid=pid, error=why[:200],
                                hint="the node agent counts a process as the job's only if it descends from "
                                     "one of the job's attested processes")
        req, w = core.worker_req(pid, node, device_bytes, swap, gpus, endpoint, tags, collective)

        def build():
            req.session_secret = core.secret()
            return req
        await self.transport.invoke(Call.REGISTER_WORKER, build, deadline=core.deadline(core.config.timeout))
        log.info("worker_registered", job=self.core.job_id, node=w.node, pid=w.pid)
        return w

    async def unregister_worker(self, pid: int | None = None, node: str | None = None) -> Worker:
        """Withdraw a worker registered with ``register_worker``."""
        core = self.core
        await self.sessions.ensure()
        req, w = core.worker_req(pid, node, 0)

        def build():
            req.session_secret = core.secret()
            return req
        await self.transport.invoke(Call.UNREGISTER_WORKER, build, deadline=core.deadline(core.config.timeout))
        return w

    def attest_worker(self, node: str):
        """Open (once) this process's channel to ``node``'s agent, proving the process is this job's;
        the pid the agent sees (its pid namespace), or None if no agent listens here. Blocking.

        The node agent acts only on pids a job attested (``--require-attestation``), so a
        job can never have another job's process snapshotted by registering its pid.
        """
        from timeslice.common.channel import ChannelError, reachable
        from timeslice.config import node_name
        from timeslice.cooperative import Attestation, CooperativeWorker
        from timeslice.errors import WrongDeviceError
        mine = [w for w in self._cooperative if w.node == node]
        if mine:
            return mine[0].pid                # a cooperative channel attests already
        if node != node_name() and not reachable(node):
            return None                       # another node's agent: not reachable from here
        if self._attestation is None:
            # The default connect time (timeslice.common.channel): a full backlog is waited out, then reported.
            w = CooperativeWorker(self.core.job_id, self.core.secret, Attestation(), node)
            try:
                w.start()
            except WrongDeviceError:
                raise                         # a simulated device nobody watches: the job must not go on
            except ChannelError as e:
                log.warning("worker_not_attested", job=self.core.job_id, node=node, error=str(e)[:200],
                            hint="the node agent acts only on attested workers when it requires attestation")
                return None
            self._attestation = w
        return self._attestation.pid

    def _vouch(self, node: str, pid: int) -> str:
        """Vouch for ``pid`` over this process's channel to ``node``'s agent: "" once it is recorded."""
        ch = next((w for w in self._cooperative if w.node == node), None) or self._attestation
        return ch.vouch(pid) if ch is not None and ch.node == node else "no channel to that node's agent"

    def _close_attestation(self) -> None:
        w, self._attestation = self._attestation, None
        if w is not None:
            w.close()

    async def cooperate(self, memory, *, node: str | None = None, socket_path: str | None = None,
                        gpus: Sequence[int] = (), prepin: bool | str = True):
        """Make this process a *cooperative* worker: it moves its own device memory when asked.

        Opens the node-local channel to the node agent (which learns this
        process's pid from the kernel), registers the worker with
        ``swap="cooperative"`` and the memory's tags, and serves the agent's
        pause/resume requests on a daemon thread. ``prepin`` pays the one-time
        cost of allocating the retained pinned host backup now, not during the
        first swap, telling the agent when the reservation starts and ends. With
        ``TorchMemory(backup="pool")`` (and the simulator) it is host work only:
        cooperate *before* the first acquire, with the regions' sizes declared
        (``host_bytes=``), and the pinning is done before the first hold (it does
        not slow another process's GPU work: ``timeslice.pinned``). With
        ``backup="tms"`` it is device work: cooperate while holding the group. It
        runs on the calling thread of the sync client, on a worker thread of the async one;
        ``prepin="background"`` runs it on a thread of its own and returns at once, so that
        the pin overlaps what the job does next (its imports, its model build, its wait in
        the queue); the first pause waits for it if it is not done.
        Returns the ``CooperativeWorker``; ``close()`` closes it too.
        """
        from timeslice.config import node_name
        from timeslice.cooperative import CooperativeWorker
        await self.sessions.ensure()
        node = node or node_name()
        await self.user.blocking(self._close_attestation)   # one channel per process: the cooperative one attests too
        w = CooperativeWorker(self.core.job_id, self.core.secret, memory, node, socket_path,
                              held=lambda: [(g, grant.token) for g, grant in self.core.grants.snapshot().items()])
        pid = await self.user.blocking(w.connect)
        try:
            await self.register_worker(pid=pid, node=node, device_bytes=sum(memory.region_bytes().values()),
                                       swap=swaps.COOPERATIVE, gpus=gpus, tags=dict(memory.tags),
                                       collective=never_checkpoint(memory))
            w.start()
            if prepin and hasattr(memory, "prepin"):
                t0 = time.monotonic()
                await self.user.blocking(w.prepin, prepin == "background")
                log.info("cooperative_prepinned", job=self.core.job_id, host_bytes=memory.host_bytes(),
                         elapsed_s=round(time.monotonic() - t0, 3))
        except BaseException:
            w.close()
            raise
        with self.core.mu:
            self._cooperative.append(w)
        from timeslice.memstats import DeviceStats
        if isinstance(memory, DeviceStats):
            self.core.memory_stats = memory      # its figures measure the holds' footprints (timeslice.memstats)
        return w

    def channels(self) -> list:
        """The channels this process has open to node agents (cooperative ones, the attestation)."""
        with self.core.mu:
            out = list(self._cooperative)
        if self._attestation is not None:
            out.append(self._attestation)
        return out

    async def sync_reports(self, timeout: float = YIELD_SYNC_TIMEOUT_S) -> None:
        """Before a Yield: have each local agent report this process's device memory as it is now.

        Why: memory a job makes inside its hold outside any cooperative region (a checkpoint
        worker's optimizer state, a cooperative worker's cache or workspaces) is seen by the agent
        only at its next periodic refresh; lockd plans the next grant at the Yield, on the report
        it has. Without a hint of the job's peak, a grant planned on the older report put another
        job on a device that was full. A refresh costs the agent milliseconds; an agent that does
        not answer within ``timeout`` delays the Yield by that much, once per Yield, and says so."""
        for w in self.channels():
            await self.user.blocking(w.announce, True, timeout)

    async def close(self) -> None:
        """At close: the cooperative channels first (the agent lifts a freeze on a worker that
        leaves), then the attestation."""
        with self.core.mu:
            workers, self._cooperative = self._cooperative, []
        for w in workers:
            await self.user.blocking(w.close)
        await self.user.blocking(self._close_attestation)
