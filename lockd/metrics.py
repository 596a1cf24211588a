"""Prometheus metrics of a lockd replica (documented in the README).

Each replica has its own registry so several replicas can run in one process
(tests, benchmarks); ``serve`` exposes it on --metrics-port.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.queue_depth = Gauge("timeslice_queue_depth", "Jobs queued per group (holder included)",
                                 ["group"], registry=r)
        self.acquire_wait = Histogram("timeslice_acquire_wait_seconds",
                                      "Acquire arrival to grant, as served by this replica",
                                      buckets=_LAT, registry=r)
        self.acquires = Counter("timeslice_acquires_total", "Acquire calls by result", ["result"],
                                registry=r)
        self.handoff = Histogram("timeslice_handoff_seconds",
                                 "Leader: a new head seen to its grant written (swap included)",
                                 buckets=_LAT, registry=r)
        self.swap = Histogram("timeslice_swap_seconds", "Leader: first intent of a swap to its grant",
                              buckets=_LAT, registry=r)
        self.agent_op = Histogram("timeslice_agent_op_seconds", "Agent-reported snapshot/restore time",
                                  ["op"], buckets=_LAT, registry=r)
        self.grants = Counter("timeslice_grants_total", "Grants written by this replica as leader",
                              registry=r)
        self.swap_failures = Counter("timeslice_swap_failures_total",
                                     "Acquires failed because a swap could not be done", registry=r)
        self.elided = Counter("timeslice_elided_swaps_total",
                              "Grants where another job stayed resident beside the new holder",
                              registry=r)
        self.deferred = Counter("timeslice_deferred_snapshots_total",
                                "Yields with nobody waiting: the job stays resident", registry=r)
        self.leader_changes = Counter("timeslice_leader_changes_total",
                                      "Times this replica became leader", registry=r)
        self.is_leader = Gauge("timeslice_is_leader", "1 while this replica leads", registry=r)
        self.etcd_connected = Gauge("timeslice_etcd_connected", "1 while the mirror is in sync with etcd",
                                    registry=r)
