"""A chaos client's COOPERATIVE worker on the SIMULATED device (``client_proc.py --coop-regions``).

Like device.py's checkpointed worker, except that the job moves its own memory. With its
first grant the client process puts a small context and tagged regions of seeded bytes on
the node's simulated device (``SimCooperativeMemory``), opens its channel to the node agent
(the client library's ``CooperativeWorker``: it reconnects by itself after an agent restart
and tells the new agent what it has paused), and registers as the job's cooperative worker
(``device_fill``). From then on:

* the worker thread writes down every pause and resume the agent asks for, as it happens
  (``coop_pausing`` -> ``coop_paused``, ``coop_resuming`` -> ``coop_resumed``, or
  ``coop_failed``): the checker learns from the job itself what was released, and when;
* at the start of every later section the job reports whether all its regions are resident
  (``memory``), then checks each region's bytes against what it left there (an offload
  region bit-exact, a discard region zeroed if it was released since), records one
  ``data_check``, and stamps every region anew.

Regions: ``--coop-regions weights:3145728:offload,kv:1572864:discard``; copies are paced by
``TIMESLICE_SIM_COOP_GBPS`` (slow them down to catch the agent mid-pause).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time
from collections.abc import Sequence

import grpc

from chaos_tests.history import HistoryRecorder
from timeslice.proto import lockd_pb2 as pb
from timeslice.sim.coop import DEFAULT_CONTEXT_BYTES, SimCooperativeMemory
from timeslice.testing.rawjob import GiveUp, RawJob

STAMP = 48


def parse_regions(spec: str) -> dict[str, tuple[int, str]]:
    """``tag:bytes:policy,...`` -> {tag: (bytes, policy)}."""
    out = {}
    for part in spec.split(","):
        tag, n, policy = part.split(":")
        if int(n) <= 2 * STAMP:
            raise ValueError(f"region {tag!r} is too small to stamp: {n} bytes")
        out[tag] = (int(n), policy)
    return out


class RecordingCoopMemory(SimCooperativeMemory):
    """The simulator's cooperative memory, writing down each pause and resume the agent asks for."""

    def __init__(self, regions: dict[str, tuple[int, str]], sim_dir: str | None, seed: int, rec: HistoryRecorder):
        super().__init__(regions, sim_dir, seed=seed)
        self.rec = rec
        self.dropped: set[str] = set()     # discard regions released since the job last checked them

    def released(self) -> list[str]:
        return sorted(t for t in self.tags if self._dev.get(t) is None)

    def pause(self, tags: Sequence[str]) -> None:
        tags = list(tags)
        self.rec.record("coop_pausing", tags=tags)
        try:
            super().pause(tags)
        except BaseException as e:
            self.rec.record("coop_failed", op="pause", tags=tags, error=f"{type(e).__name__}: {e}"[:300])
            raise
        self.dropped.update(t for t in tags if self.tags[t] == "discard")
        self.rec.record("coop_paused", tags=tags)

    def resume(self, tags: Sequence[str]) -> None:
        tags = list(tags)
        self.rec.record("coop_resuming", tags=tags)
        try:
            super().resume(tags)
        except BaseException as e:
            self.rec.record("coop_failed", op="resume", tags=tags, error=f"{type(e).__name__}: {e}"[:300])
            raise
        self.rec.record("coop_resumed", tags=tags)


class SimCoopWorkerDevice:
    backend = "cooperative"

    def __init__(self, a: argparse.Namespace, job: RawJob, rec: HistoryRecorder):
        self.a, self.job, self.rec = a, job, rec
        self.regions = parse_regions(a.coop_regions)
        self.mem: RecordingCoopMemory | None = None
        self.worker = None                      # timeslice.cooperative.CooperativeWorker, after the first fill
        self.expected: dict[str, str] = {}      # tag -> sha256 the region must have (our own account)
        self.lost = False

    @property
    def footprint(self) -> int:
        """Device bytes this job needs while running: context + every region (its Acquire's hint)."""
        return DEFAULT_CONTEXT_BYTES + sum(n for n, _ in self.regions.values())

    def _short(self) -> float:
        return 2 * len(self.job.targets) * self.a.rpc_timeout

    async def register(self) -> None:
        """Tell lockd this process is the job's cooperative worker on the node (once it is)."""
        if self.worker is None:
            return
        await self.job.call("RegisterWorker", pb.WorkerRequest(
            job_id=self.a.job, session_secret=self.job.secret, node=self.a.node, pid=self.worker.pid or os.getpid(),
            device_bytes=sum(n for n, _ in self.regions.values()), swap="cooperative",
            tags=[pb.TagPolicy(tag=t, policy=p) for t, (_, p) in self.regions.items()]), timeout=self._short())

    def memory_report(self) -> dict | None:
        """Are all our regions resident, right at the grant? (None before the first fill.)"""
        if self.mem is None or self.worker is None:
            return None
        released = self.mem.released()
        return {"back": not released, "backend": self.backend, "released": released,
                "paused": list(self.worker.paused),
                "detail": f"regions {released} released" if released else "every region resident"}

    async def touch(self, group: str, token: int) -> None:
        if self.mem is None:
            if not self.lost:
                await self._first_fill(group)
        else:
            await asyncio.to_thread(self._check_and_stamp, group, token)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # -- the first grant -------------------------------------------------------------------
    async def _first_fill(self, group: str) -> None:
        """The scheduler made room: put our memory on the device, open the channel, register."""
        from timeslice.common.channel import ChannelError
        from timeslice.cooperative import CooperativeWorker

        try:
            self.mem = await asyncio.to_thread(RecordingCoopMemory, self.regions, self.a.sim_dir, self.a.seed,
                                               self.rec)
        except Exception as e:  # DeviceOutOfMemory: the grant came without room
            self.lost = True
            self.rec.data_check(group, False, f"no room for our {self.footprint} bytes at our first grant: "
                                f"{type(e).__name__}: {e}"[:300])
            return
        self.expected = {t: self.mem.expected(t) for t in self.regions}
        self.rec.record("device_fill", group=group, backend=self.backend, bytes=self.footprint)
        self.worker = w = CooperativeWorker(self.a.job, lambda: self.job.secret, self.mem, self.a.node,
                                            self.a.agent_socket)
        deadline = time.monotonic() + 3 * self.a.device_timeout     # the agent may be restarting
        while True:
            try:
                await asyncio.to_thread(w.connect)
                break
            except ChannelError as e:
                if time.monotonic() > deadline:
                    self.job.log(f"no channel to the agent: {e}")
                    raise
                await asyncio.sleep(0.2)
        await self.register()
        w.start()
        await asyncio.to_thread(self.mem.prepin)
        w.announce()
        await self._wait_reported(group)

    async def _wait_reported(self, group: str) -> None:
        """Keep the section until the agent reports our bytes on the device (as device.py does)."""
        deadline = time.monotonic() + self.a.device_timeout
        while time.monotonic() < deadline:
            try:
                st = await self.job.call("GetGroupStatus", pb.GroupRef(group_id=group), timeout=self._short())
                ns = next((n for n in st.node_status if n.node == self.a.node), None)
                if ns is not None and ns.agent_alive and ns.device_free_bytes <= ns.device_total_bytes - self.footprint:
                    return
            except (grpc.aio.AioRpcError, GiveUp):
                pass
            await asyncio.sleep(0.05)
        self.job.log(f"agent did not report our {self.footprint} bytes within {self.a.device_timeout}s")

    # -- every later grant -----------------------------------------------------------------
    def _check_and_stamp(self, group: str, token: int) -> None:
        from timeslice.common.device_errors import IllegalState

        assert self.mem is not None
        bad = []
        for tag, (n, _policy) in self.regions.items():
            try:
                with self.mem.compute(tag, timeout_s=self.a.device_timeout) as view:
                    got = hashlib.sha256(view).hexdigest()
                    dropped = tag in self.mem.dropped
                    want = hashlib.sha256(bytes(n)).hexdigest() if dropped else self.expected[tag]
                    if got != want:
                        bad.append(f"{tag}: sha256 {got[:16]} != {want[:16]} "
                                   f"({'zeroed after a discard' if dropped else 'as we left it'})")
                    stamp = f"{self.a.job}:{token}:{tag}".encode()[:STAMP].ljust(STAMP, b".")
                    off = (token * 4099) % (n - STAMP)
                    view[off:off + STAMP] = stamp
                    self.expected[tag] = hashlib.sha256(view).hexdigest()
                self.mem.dropped.discard(tag)
            except IllegalState as e:
                bad.append(f"{tag}: released in a granted section ({e})"[:300])
            except TimeoutError as e:
                bad.append(f"{tag}: device not usable {self.a.device_timeout}s into the section: {e}"[:300])
        self.rec.data_check(group, not bad, "; ".join(bad) if bad else f"regions {sorted(self.regions)} intact",
                            token=token)
