"""A chaos client's GPU worker on the SIMULATED device (``client_proc.py --sim-bytes``).

The client process registers itself on the node's simulated device
(``timeslice.common.sim``); with its first grant it allocates and fills an arena and
registers as the job's worker with lockd (``device_fill``); at the start of every
later critical section it reports whether its memory is back (``memory``: the
process running on the device, its arena whole), then checks that its device
bytes are exactly what it left there (the node agent may have snapshotted and
restored them in between), recording a ``data_check``, then changes them.
``coopdevice.py`` is the same for a cooperative worker. Device calls block (while the context is
away), so they run in a thread: the job's keepalive goes on meanwhile.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import time

import grpc

from chaos_tests.history import HistoryRecorder
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing.rawjob import GiveUp, RawJob


class SimWorkerDevice:
    backend = "checkpoint"

    def __init__(self, a: argparse.Namespace, job: RawJob, rec: HistoryRecorder):
        from timeslice.sim.runtime import SimDeviceClient

        self.a, self.job, self.rec = a, job, rec
        self.dev = SimDeviceClient.open(a.sim_dir)    # the arena comes with the first grant
        self.expected_sha = ""
        self.lost = False
        self.attestation = None                       # timeslice.cooperative.CooperativeWorker (attest only)

    @property
    def footprint(self) -> int:
        """Device bytes this job needs (its Acquire's hint)."""
        return self.a.sim_bytes

    def memory_report(self) -> dict | None:
        """Is our memory back, right at the grant? (None before the first fill.) Never blocks.

        Back: the arena whole and the process not checkpointed. A process still locked (frozen
        after a lost session, thawed a moment after it re-registered) has its memory on the
        device; if it stays locked, the section's data check says so after ``--device-timeout``."""
        from timeslice.common.sim.device import CHECKPOINTED

        if not self.expected_sha or self.lost:
            return None
        doc = self.dev.dev.read_state(self.dev.pid)
        state = doc["state"] if doc else "unregistered"
        try:
            size = os.path.getsize(self.dev.dev.arena(self.dev.pid))
        except FileNotFoundError:
            size = 0
        back = state not in (CHECKPOINTED, "unregistered") and size >= self.a.sim_bytes
        return {"back": back, "backend": self.backend,
                "detail": f"process {state} on the simulated device, arena {size} of {self.a.sim_bytes} bytes"}

    def close(self) -> None:
        if self.attestation is not None:
            self.attestation.close()

    def _short(self) -> float:
        return 2 * len(self.job.targets) * self.a.rpc_timeout

    def _attest(self) -> None:
        """Prove to the node agent that this process is the job's (its channel, as the client library's
        ``register_worker`` does), so an agent that requires attestation acts on it. Kept open: it
        reconnects by itself after an agent restart. Blocking."""
        if self.attestation is not None or not self.a.agent_socket:
            return
        from timeslice.cooperative import Attestation, CooperativeWorker

        self.attestation = CooperativeWorker(self.a.job, lambda: self.job.secret, Attestation(), self.a.node,
                                             self.a.agent_socket).start()

    async def register(self) -> None:
        """Tell lockd this process holds the job's device memory (once it does)."""
        if not self.expected_sha:
            return
        try:
            await asyncio.to_thread(self._attest)
        except Exception as e:  # the agent is restarting: the registration goes on, the next one attests
            self.job.log(f"not attested yet: {e}")
        await self.job.call("RegisterWorker", pb.WorkerRequest(
            job_id=self.a.job, session_secret=self.job.secret, node=self.a.node, pid=os.getpid(),
            device_bytes=self.a.sim_bytes), timeout=self._short())

    async def touch(self, group: str, token: int) -> None:
        """Check that the device bytes survived since our last section, then change them."""
        if not self.expected_sha:
            await self._first_fill(group)
        elif not self.lost:
            await asyncio.to_thread(self._check_and_stamp, group, token)

    def _fill(self) -> None:
        self.dev.alloc(self.a.sim_bytes, timeout_s=self.a.device_timeout)
        data = random.Random(self.a.seed).randbytes(self.a.sim_bytes)
        with self.dev.compute(timeout_s=self.a.device_timeout) as mem:
            mem[:] = data
        self.expected_sha = hashlib.sha256(data).hexdigest()

    async def _first_fill(self, group: str) -> None:
        """First grant: the scheduler made room; allocate, fill, and tell lockd about it.

        The section lasts until the node agent reports the allocation (free
        device memory dropped by our bytes), as a job's first phase would keep
        the GPU while loading: the leader decides later swaps from that report.
        """
        await asyncio.to_thread(self._fill)
        self.rec.record("device_fill", group=group, backend=self.backend, bytes=self.a.sim_bytes)
        await self.register()
        deadline = time.monotonic() + self.a.device_timeout
        while time.monotonic() < deadline:
            try:
                st = await self.job.call("GetGroupStatus", pb.GroupRef(group_id=group), timeout=self._short())
                ns = next((n for n in st.node_status if n.node == self.a.node), None)
                if ns is not None and ns.agent_alive and ns.device_free_bytes <= ns.device_total_bytes - self.a.sim_bytes:
                    return
            except (grpc.aio.AioRpcError, GiveUp):
                pass
            await asyncio.sleep(0.05)
        self.job.log(f"agent did not report our {self.a.sim_bytes} bytes within {self.a.device_timeout}s")

    def _check_and_stamp(self, group: str, token: int) -> None:
        try:
            with self.dev.compute(timeout_s=self.a.device_timeout) as mem:
                # Touching a mapping whose file shrank would kill us with SIGBUS:
                # look first, so that a lost context is a recorded failure, not a crash.
                size = os.path.getsize(self.dev.dev.arena(self.dev.pid))
                if size < self.a.sim_bytes:
                    self.lost = True
                    self.rec.data_check(group, False, f"device memory gone: the arena holds {size} of "
                                        f"{self.a.sim_bytes} bytes in a granted section", token=token)
                    return
                got, want = hashlib.sha256(mem).hexdigest(), self.expected_sha
                ok = got == want
                stamp = f"{self.a.job}:{token}".encode().ljust(32, b".")
                off = (token * 4099) % (len(mem) - 32)
                mem[off:off + 32] = stamp
                self.expected_sha = hashlib.sha256(mem).hexdigest()
            self.rec.data_check(group, ok, "device bytes intact" if ok else
                                f"device sha256 {got[:16]} != expected {want[:16]}", token=token)
        except TimeoutError as e:
            # The grant came while our context was not on the device.
            self.rec.data_check(group, False, f"device not usable {self.a.device_timeout}s into the "
                                f"section: {e}", token=token)
