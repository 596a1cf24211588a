"""Prometheus metrics of a node agent (documented in the README).

Each agent has its own registry, so several agents can live in one process
(tests); ``serve`` exposes it on --metrics-port.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_OP = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ops = Counter("timeslice_agent_ops_total",
                           "Snapshot/restore ops by outcome (ok|failed|refused|gone) and source (intent|direct)",
                           ["op", "outcome", "source"], registry=r)
        self.op_seconds = Histogram("timeslice_agent_op_seconds",
                                    "Time of the backend op for a whole job (all its processes)",
                                    ["op"], buckets=_OP, registry=r)
        self.bytes_moved = Counter("timeslice_agent_bytes_moved_total",
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
