"""A library chaos client's GPU worker on the SIMULATED device (``client_proc.py --library --sim-bytes``
or ``--coop-regions``): device.py's and coopdevice.py's workers, registered through the public client.

The raw client registers its worker with lockd's RegisterWorker itself; a job written against
``OrchestratorClient`` calls ``register_worker`` (which attests the process over the node agent's
channel first) or ``cooperate`` (which opens the cooperative channel, attesting it, and registers).
Everything the checker judges is the same: ``device_fill`` at the first grant, a ``memory`` report
at the start of each section, then a ``data_check`` of the job's bytes, and for a cooperative job the
``coop_*`` events its memory writes down as the agent asks it to pause and resume.

After ``reset_session()`` (a session lost) the job's registrations went with the old session:
``register`` makes them again, as a job does.
"""
from __future__ import annotations

import argparse
import time
import types

from chaos_tests.coopdevice import RecordingCoopMemory, SimCoopWorkerDevice
from chaos_tests.device import SimWorkerDevice
from chaos_tests.history import HistoryRecorder
from timeslice import OrchestratorClient
from timeslice.errors import TimesliceClientError


def _no_raw_job() -> types.SimpleNamespace:
    """The raw devices log through their RawJob; here the log is stderr."""
    import sys
    return types.SimpleNamespace(log=lambda m: print(f"{time.monotonic():.3f} {m}", file=sys.stderr, flush=True),
                                 secret="")


class _Reported:
    """Keep a first section until the agent reports the job's bytes (as the raw devices do)."""

    a: argparse.Namespace
    c: OrchestratorClient

    def wait_reported(self, group: str, nbytes: int) -> None:
        """(On a node of several GPUs the node's free bytes may drop for another job's memory: the job
        itself must be listed as resident.)"""
        deadline = time.monotonic() + self.a.device_timeout
        while time.monotonic() < deadline:
            try:
                st = self.c.status(group)
                ns = next((n for n in st.node_status if n.node == self.a.node), None)
                if ns is not None and ns.agent_alive and self.a.job in ns.resident_jobs and \
                        ns.device_free_bytes <= ns.device_total_bytes - nbytes:
                    return
            except TimesliceClientError:
                pass
            time.sleep(0.05)


class LibCheckpointDevice(_Reported):
    backend = "checkpoint"

    def __init__(self, a: argparse.Namespace, c: OrchestratorClient, rec: HistoryRecorder):
        self.a, self.c, self.rec = a, c, rec
        self.dev = SimWorkerDevice(a, _no_raw_job(), rec)       # its arena, fill, memory report and checks

    @property
    def footprint(self) -> int:
        return self.a.sim_bytes

    def memory_report(self) -> dict | None:
        return self.dev.memory_report()

    def register(self) -> None:
        if self.dev.expected_sha:
            self.c.register_worker(node=self.a.node, device_bytes=self.a.sim_bytes)

    def touch(self, group: str, token: int) -> None:
        if self.dev.lost:
            return
        if self.dev.expected_sha:
            self.dev._check_and_stamp(group, token)
            return
        try:
            self.dev._fill()
        except Exception as e:  # DeviceOutOfMemory: the grant came without room
            self.dev.lost = True
            self.rec.data_check(group, False, f"no room for our {self.a.sim_bytes} bytes at our first grant: "
                                f"{type(e).__name__}: {e}"[:300])
            return
        self.rec.record("device_fill", group=group, backend=self.backend, bytes=self.a.sim_bytes)
        self.register()
        self.wait_reported(group, self.a.sim_bytes)

    def close(self) -> None:
        pass


class LibCoopDevice(_Reported):
    backend = "cooperative"

    def __init__(self, a: argparse.Namespace, c: OrchestratorClient, rec: HistoryRecorder):
        self.a, self.c, self.rec = a, c, rec
        self.dev = SimCoopWorkerDevice(a, _no_raw_job(), rec)   # its regions, memory report and checks

    @property
    def footprint(self) -> int:
        return self.dev.footprint

    def memory_report(self) -> dict | None:
        return self.dev.memory_report()

    def register(self) -> None:
        w = self.dev.worker
        if w is not None:
            self.c.register_worker(pid=w.pid, node=self.a.node, device_bytes=sum(n for n, _ in
                                                                                 self.dev.regions.values()),
                                   swap="cooperative", tags={t: p for t, (_, p) in self.dev.regions.items()})

    def touch(self, group: str, token: int) -> None:
        d = self.dev
        if d.mem is not None:
            d._check_and_stamp(group, token)
            return
        if d.lost:
            return
        try:
            d.mem = RecordingCoopMemory(d.regions, self.a.sim_dir, self.a.seed, self.rec)
        except Exception as e:  # DeviceOutOfMemory: the grant came without room
            d.lost = True
            self.rec.data_check(group, False, f"no room for our {d.footprint} bytes at our first grant: "
                                f"{type(e).__name__}: {e}"[:300])
            return
        d.expected = {t: d.mem.expected(t) for t in d.regions}
        self.rec.record("device_fill", group=group, backend=self.backend, bytes=d.footprint)
        # The library's cooperate: the channel (attesting this process), the registration, the pinned pool.
        from timeslice.common.channel import ChannelError
        deadline = time.monotonic() + 3 * self.a.device_timeout     # the agent may be restarting
        while True:
            try:
                d.worker = self.c.cooperate(d.mem, node=self.a.node, socket_path=self.a.agent_socket)
                break
            except ChannelError as e:
                if time.monotonic() > deadline:
                    raise
                print(f"no channel to the agent yet: {e}", flush=True)
                time.sleep(0.2)
        self.wait_reported(group, d.footprint)

    def close(self) -> None:
        pass                                     # the client's close closes the channel
