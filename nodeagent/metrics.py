"""Prometheus metrics of a node agent (documented in the README).

Each agent has its own registry, so several agents can live in one process
(tests); ``serve`` exposes it on --metrics-port. Naming follows
``timeslice.common.server.metrics_common``.

Duty cycle: ``timeslice_agent_gpu_utilization_ratio{gpu}`` is read at scrape
time from ``gpu_utilization`` (a callable the agent sets: NVML's utilization
rate on NVIDIA, the simulated device's busy fraction in CI), and
``timeslice_agent_job_resident_seconds_total{job}`` counts how long each job's
context sat on this node's devices (``note_resident`` with the jobs resident
now, called on each refresh); a job's series goes when it is gone.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from timeslice.common.server.metrics_common import LATENCY_BUCKETS, add_common


class DutyCycle:
    """Scrape-time collector of GPU utilization and per-job residency."""

    def __init__(self, registry: CollectorRegistry):
        self.gpu_utilization: Callable[[], Mapping[str, float] | None] | None = None
        self.resident_s: dict[str, float] = {}
        self._last: tuple[float, frozenset[str]] | None = None
        registry.register(self)

    def note_resident(self, jobs: Iterable[str], now: float | None = None) -> None:
        """Credit the jobs resident since the last call; forget jobs no longer resident."""
        now = time.monotonic() if now is None else now
        jobs = frozenset(jobs)
        if self._last is not None:
            t0, before = self._last
            for j in before & jobs:
                self.resident_s[j] = self.resident_s.get(j, 0.0) + (now - t0)
        for j in [j for j in self.resident_s if j not in jobs]:
            del self.resident_s[j]
        for j in jobs:
            self.resident_s.setdefault(j, 0.0)
        self._last = (now, jobs)

    def collect(self):
        util = GaugeMetricFamily("timeslice_agent_gpu_utilization_ratio",
                                 "Fraction of time each GPU was busy (NVML; the simulated device in CI)",
                                 labels=["gpu"])
        for gpu, v in sorted(((self.gpu_utilization() if self.gpu_utilization else None) or {}).items()):
            util.add_metric([str(gpu)], float(v))
        yield util
        held = CounterMetricFamily("timeslice_agent_job_resident_seconds",
                                   "Seconds each job's context has been on this node's devices", labels=["job"])
        for job, s in sorted(self.resident_s.items()):
            held.add_metric([job], s)
        yield held


def nvml_utilization() -> dict[str, float] | None:
    """Per-GPU utilization from NVML, or None where there is no NVML (the simulator, CI)."""
    from timeslice.common.device_errors import BackendUnavailable
    from timeslice.nodeagent.backends.nvml import Nvml
    try:
        n = Nvml.open()
    except BackendUnavailable:
        return None
    try:
        return n.utilization()
    except Exception:  # a scrape must not fail because one NVML call did
        return None
    finally:
        n.close()


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        add_common(r, "nodeagent")
        self.ops = Counter("timeslice_agent_ops_total",
                           "Snapshot/restore ops by outcome (ok|failed|refused|gone) and source (intent|direct)",
                           ["op", "outcome", "source"], registry=r)
        self.op_seconds = Histogram("timeslice_agent_op_seconds",
                                    "Time of the backend op for a whole job (all its processes)",
                                    ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.bytes_moved = Counter("timeslice_agent_moved_bytes",
                                   "Bytes copied between device and host", ["op"], registry=r)
        self.inflight = Gauge("timeslice_agent_ops_in_flight", "Ops running now", registry=r)
        self.superseded = Counter("timeslice_agent_superseded_total",
                                  "Op results not written because a newer intent had arrived", registry=r)
        self.etcd_connected = Gauge("timeslice_agent_etcd_connected",
                                    "1 while the agent can reach etcd", registry=r)
        self.host_free = Gauge("timeslice_agent_host_free_bytes",
                               "Host memory a snapshot may use (MemAvailable minus the reserve)", registry=r)
        self.device_free = Gauge("timeslice_agent_device_free_bytes", "Free device memory, all devices",
                                 registry=r)
        self.residue = Gauge("timeslice_agent_job_residue_bytes",
                             "Device bytes a cooperatively parked job still holds here (its worker's measure)",
                             ["job"], registry=r)
        self.duty = DutyCycle(r)

    def note_residue(self, parked: dict[str, int]) -> None:
        """The residue of each cooperatively parked job now; a job that resumed or left drops out."""
        self.residue.clear()
        for job, n in parked.items():
            self.residue.labels(job).set(n)
