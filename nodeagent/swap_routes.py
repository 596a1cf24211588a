"""Which swapper moves each pid's memory: none (the checkpoint backend), cooperative, or an app server.

A pid's registration (``jobs/<job>/workers/<node>/<pid>``, ``WorkerValue.swap``: a kind
of ``common/swaps.py``) decides; the kind's swapper class builds it (``for_worker``). The registration is looked up in the agent's jobs mirror, unless the
op path has just read a newer one from etcd (``note``): the op decides from
that fresh read, and the mirror may not have applied it yet. Looked up in a
lagging mirror, a cooperative worker would pass for a plain process with no
device context ("nothing to snapshot: the job is running already") while its
memory is still on the device. The fresh entry is used only while its
mod_revision is newer than the mirror's revision; then the mirror is the truth
again.

A process that said hello as a cooperative worker stays one for as long as it
lives, registered or not: a job that closes its session loses its registrations
at once, and its process (often still holding its memory, on its way out) must
never pass for one that the checkpoint backend may take (it has no arena the
driver could copy, and a half-written host copy would be left behind).

``resolve`` is called from the backend's worker threads: it reads plain dicts
and replaces them whole, never mutating one another thread iterates.
"""
from __future__ import annotations

from aetcd import rpc

from timeslice.common import swaps
from timeslice.common.server import records as R
from timeslice.nodeagent.backends.swapper import SwapEnv, Swapper, swapper_class
from timeslice.nodeagent.channel import ChannelServer
from timeslice.nodeagent.jobs import LocalJobs


class SwapRoutes:
    def __init__(self, jobs: LocalJobs, env: SwapEnv):
        """``env``: what every swapper is built with (the channel, the reconnect wait, the meter, the drain)."""
        self.jobs, self.env = jobs, env
        self.channel: ChannelServer = env.channel
        self._made: dict[int, tuple[str, str, Swapper]] = {}          # pid -> (job, kind, swapper)
        self._fresh: dict[int, tuple[int, str, R.WorkerValue]] = {}   # pid -> (mod_revision, job, registration)

    def note(self, job: str, read: list[tuple[rpc.KeyValue, R.WorkerValue]]) -> None:
        """The op path read ``job``'s registrations fresh from etcd: (key-value, decoded) pairs."""
        seen = self.jobs.workers_revision
        fresh = {p: v for p, v in self._fresh.items() if v[0] > seen}   # drop what the mirror has
        for kv, reg in read:
            named = self.jobs.local_worker(kv.key)              # (job, pid) the key registers
            if named is not None and kv.mod_revision > seen:
                fresh[named[1]] = (kv.mod_revision, job, reg)
        self._fresh = fresh

    def registration(self, pid: int) -> tuple[str, R.WorkerValue] | None:
        """``pid``'s (job, registration): the newer of the fresh read and the jobs mirror."""
        fresh = self._fresh.get(pid)
        if fresh is not None and fresh[0] > self.jobs.workers_revision:
            return fresh[1], fresh[2]
        return self.jobs.local_workers().get(pid)

    def resolve(self, pid: int) -> Swapper | None:
        """The swapper of ``pid`` if its registration asks for one (None: the checkpoint backend)."""
        reg = self.registration(pid)
        if reg is None:
            # Not registered (any more): a process that said hello as a cooperative worker is one
            # (its job closed, or its session went while it was parked: its memory moves only by it).
            info = self.channel.info(pid)
            if info is None or not info.tags or self.channel.job_of(pid) != info.job:
                self._made.pop(pid, None)
                return None
            job, kind = info.job, swaps.COOPERATIVE
        else:
            job, kind = reg[0], reg[1].swap
        known = swaps.kind_of(kind)
        if known is not None and not known.swapper:
            return None                                   # the checkpoint backend moves it
        hit = self._made.get(pid)
        if hit is not None and hit[:2] == (job, kind):
            return hit[2]
        sw = swapper_class(kind).for_worker(self.env, pid, job, reg[1] if reg is not None else None)
        self._made[pid] = (job, kind, sw)
        return sw

    def cooperative(self, pid: int) -> bool:
        """True if ``pid``'s memory is moved by the process itself, over its channel."""
        sw = self.resolve(pid)
        return sw is not None and sw.kind == swaps.COOPERATIVE
