"""Room for a holder's allocation: move parked jobs' residue off its GPU when it asks (the ``room`` frame).

A cooperative worker whose allocation did not fit inside its hold asks its node agent
for room over its channel (``timeslice.room``). What other jobs parked on that GPU left
there outside their regions (their residue: a CUDA context, allocator blocks) is what
the agent can move: by the checkpoint full isolation uses, the same op the planner asks
for when a residue is in the next job's way (``lockd.residency.residue_holders``), for
the same jobs: parked cooperatively, with a residue on that device, and never one with
a ``collective`` worker (a driver restore of a CUDA IPC / NCCL context loses it). Each
runs under that job's op lock (an intent for it waits, then finds it done), and its
status is corrected to say where its memory is now (residue 0, the snapshot's size
with the rest in it), as a drift correction keeps the answer to the intent it has.

Trust: room is made only for a job that holds a group on this node, as etcd says
(its grant, with the token the worker names); a parked job is moved only the way
lockd would have it moved, and its next restore brings everything back. The answer
says what was freed and who holds the device now: jobs and their bytes, and the
processes no job registered (the device meter's other pids), so a job that cannot be
given room is told why.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from timeslice.common import frames as F
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.channel import ChannelServer, WorkerInfo
from timeslice.nodeagent.jobs import LocalJobs, load_status
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.reporter import Reporter
from timeslice.nodeagent.runner import Runner

log = structlog.get_logger(__name__)

MAX_HELD = 16                  # (group, token) pairs a room request may name


class RoomMaker:
    def __init__(self, node: str, keys: Keys, client: EtcdClient, jobs: LocalJobs, channel: ChannelServer,
                 processes: JobProcesses, runner: Runner, reporter: Reporter, backend: Any,
                 refresh: Callable[[], Any]):
        """``backend``: the agent's composite backend (its base's meter names the device's other
        processes); ``refresh()``: the agent key rewritten (lockd sees the room at once)."""
        self.node, self.keys, self.client, self.jobs = node, keys, client, jobs
        self.channel, self.processes, self.runner, self.reporter = channel, processes, runner, reporter
        self.backend, self.refresh = backend, refresh
        self._mu = asyncio.Lock()      # one room request at a time on the node: they compete for the same residue

    async def answer(self, info: WorkerInfo, msg: dict) -> dict:
        """The ``roomed`` frame for a worker's ``room`` request."""
        device = str(msg.get("device") or info.device)
        need = int(msg.get("bytes") or 0)
        why = await self._holds(info.job, msg.get("held") or [])
        if why:
            log.warning("room_refused", job=info.job, pid=info.pid, device=device, reason=why)
            return F.roomed(msg["id"], 0, await self._free(device), await self._holders(device, info.job), why)
        async with self._mu:
            freed, moved = 0, []
            for job, _residue in await self._parked_residue(device, info.job):
                if freed >= need > 0:
                    break
                got = await self._move(job)
                if got > 0:
                    freed += got
                    moved.append(job)
            if moved:
                await self.refresh()
        holders = await self._holders(device, info.job)
        note = "" if freed else ("nothing left to move: no parked job's residue is on this device"
                                 if not moved else "")
        log.info("room_made", job=info.job, pid=info.pid, device=device, need_bytes=need, freed_bytes=freed,
                 moved=moved, holders=holders)
        return F.roomed(msg["id"], freed, await self._free(device), holders, note)

    async def _holds(self, job: str, held: list) -> str:
        """"" if ``job`` holds one of the named (group, token) grants and the group covers this node."""
        pairs = [(str(g), int(t)) for g, t in (p for p in held[:MAX_HELD] if isinstance(p, list | tuple)
                                               and len(p) == 2)]
        for group, token in pairs:
            try:
                # Linearizable reads: room is made for a grant that holds now, not one a mirror remembers.
                g = await self.client.range(ops.range_req(self.keys.grant(group)))
                s = await self.client.range(ops.range_req(self.keys.spec(group)))
            except Exception as e:  # etcd unreachable: no room is made on a word we cannot check
                return f"the node agent could not check the grant ({str(e)[:120]})"
            if not g.kvs or not s.kvs:
                continue
            grant, spec = R.GrantValue.load(g.kvs[0].value), R.GroupSpec.load(s.kvs[0].value)
            if grant.job == job and grant.token == token and self.node in spec.node_names():
                return ""
        return (f"job {job} holds no group on node {self.node} (named {len(pairs)}): "
                "room is made only for an allocation inside a hold")

    async def _parked_residue(self, device: str, asker: str) -> list[tuple[str, int]]:
        """Jobs parked cooperatively here with a residue on ``device`` that may be moved, largest first."""
        out = []
        for st in self.jobs.statuses():
            if st.job == asker or st.state != R.SNAPSHOTTED or st.residue_bytes <= 0:
                continue
            devices = {i.device for p, i in ((p, self.channel.info(p)) for p in st.pids) if i is not None}
            if device and devices and device not in devices:
                continue
            regs = await self.processes.registrations(st.job)
            if any(w.collective for w in regs):
                continue                               # a driver restore of its context would lose it
            out.append((st.job, st.residue_bytes))
        return sorted(out, key=lambda x: -x[1])

    async def _move(self, job: str) -> int:
        """Checkpoint what ``job``'s pause left on the device; the bytes it moved (0: nothing, or failed)."""
        async with self.runner.lock(job):
            skv = self.jobs.status_kv(job)
            old = load_status(skv.value) if skv is not None else None
            registered, remembered = await self.processes.pids(job)
            pic = await self.runner.picture(registered, remembered)
            if old is None or old.state != R.SNAPSHOTTED or pic.state != R.SNAPSHOTTED or pic.residue_bytes <= 0:
                return 0                               # moved meanwhile (an intent of lockd's did it)
            rr = await self.runner.run(R.SNAPSHOT, job, pic.live_pids, "room", isolation=R.ISOLATION_FULL)
            if rr.outcome != R.OK:
                log.warning("room_move_failed", job=job, outcome=rr.outcome, error=rr.result.error)
                return 0
            new = I.corrected(old, rr.after)
            if new is not None:
                new = R.StatusValue(**{**new.__dict__, "bytes": old.bytes + rr.bytes_moved})
                assert skv is not None
                await self.reporter.correct(job, new, skv.mod_revision)
            moved = max(0, pic.residue_bytes - rr.after.residue_bytes)
            log.info("room_residue_moved", job=job, bytes=rr.bytes_moved, residue_before=pic.residue_bytes,
                     residue_after=rr.after.residue_bytes, elapsed_ms=round(rr.elapsed_ms, 1))
            return moved

    async def _free(self, device: str) -> int:
        free = await asyncio.to_thread(self.backend.device_free) or {}
        if device in free:
            return int(free[device])
        return int(next(iter(free.values()))) if len(free) == 1 else -1

    async def _holders(self, device: str, asker: str) -> list[dict]:
        """Who holds ``device`` now: each job's bytes there (what it is doing), then the processes no
        local job accounts for (the meter's other pids: not registered, or another node's agent's)."""
        pictures = {}
        local = self.jobs.local()
        for job, (reg, rem) in local.items():
            pictures[job] = await self.runner.picture(self.processes.trusted(job, reg), rem)
        out: list[dict] = []
        known: set[int] = set()
        for job, pic in pictures.items():
            known.update(pic.states)
            on = sum(n for p, per in pic.usage.items() for d, n in per.items() if not device or d == device)
            on += sum(n for per in pic.left.values() for d, n in per.items() if not device or d == device)
            if pic.state == R.SNAPSHOTTED:
                on = pic.residue_bytes
            if on <= 0:
                continue
            what = ("this job" if job == asker else "parked: its residue" if pic.state == R.SNAPSHOTTED
                    else str(pic.state))
            out.append({"job": job, "bytes": int(on), "what": what})
        meter = getattr(getattr(self.backend, "base", self.backend), "meter", None)
        listing = getattr(meter, "processes", None)
        if listing is not None:
            others = await asyncio.to_thread(listing)
            for pid, per in sorted((others or {}).items()):
                n = sum(v for d, v in per.items() if not device or d == device)
                if pid not in known and n > 0:
                    out.append({"pid": int(pid), "bytes": int(n), "what": "not registered with timeslice"})
        return sorted(out, key=lambda h: -int(h["bytes"]))[:F.MAX_HOLDERS]
