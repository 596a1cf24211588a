"""Prometheus metrics of a lockd replica (documented in the README).

Each replica has its own registry so several replicas can run in one process
(tests, benchmarks); ``serve`` exposes it on --metrics-port. Naming follows
``timeslice.common.server.metrics_common``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from timeslice.common.server.metrics_common import LATENCY_BUCKETS, add_common

_LAT = LATENCY_BUCKETS


class QueueDepth:
    """``timeslice_queue_depth{group}``, exported only for groups that exist.

    Set like a labelled gauge (``.labels(group).set(n)``); at scrape time the
    groups that ``live_groups()`` no longer names are dropped, so deleted
    groups leave no series behind (a Gauge would keep them for ever).
    """

    def __init__(self, registry: CollectorRegistry):
        self.values: dict[str, float] = {}
        self.live_groups: Callable[[], Iterable[str]] | None = None
        registry.register(self)

    def labels(self, group: str) -> QueueDepth._Child:
        return QueueDepth._Child(self, group)

    class _Child:
        def __init__(self, parent: QueueDepth, group: str):
            self.parent, self.group = parent, group

        def set(self, value: float) -> None:
            self.parent.values[self.group] = float(value)

    def remove(self, group: str) -> None:
        self.values.pop(group, None)

    def prune(self) -> None:
        if self.live_groups is not None:
            live = set(self.live_groups())
            for g in [g for g in self.values if g not in live]:
                del self.values[g]

    def collect(self):
        self.prune()
        fam = GaugeMetricFamily("timeslice_queue_depth", "Jobs queued per group (holder included)",
                                labels=["group"])
        for g, v in sorted(self.values.items()):
            fam.add_metric([g], v)
        yield fam


class JobFractions:
    """``timeslice_job_busy_ratio{group,job}`` and ``timeslice_job_wait_ratio{group,job}``.

    Read at scrape time from the jobs' profiles (lockd/profiles.py) by the leader: of a
    job's recent cycle (hold + gap + wait), the share it held the group and the share it
    waited. ``source()`` names only jobs with a live session, so departed jobs leave no
    series behind; other replicas export none (one series per job in the cluster).
    """

    def __init__(self, registry: CollectorRegistry):
        # (group, job) -> (busy, wait) of the live jobs; {} while not leading
        self.source: Callable[[], dict[tuple[str, str], tuple[float, float]]] = dict
        registry.register(self)

    def collect(self):
        busy = GaugeMetricFamily("timeslice_job_busy_ratio",
                                 "Leader: share of a job's recent cycle it held the group", labels=["group", "job"])
        wait = GaugeMetricFamily("timeslice_job_wait_ratio",
                                 "Leader: share of a job's recent cycle it waited for the group (swaps included)",
                                 labels=["group", "job"])
        for (g, j), (b, w) in sorted(self.source().items()):
            busy.add_metric([g, j], b)
            wait.add_metric([g, j], w)
        yield busy
        yield wait


class LockdMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        add_common(r, "lockd")
        self.queue_depth = QueueDepth(r)
        self.job_fractions = JobFractions(r)
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
        # The swap split by phase: snapshot and restore as the agents reported them
        # for intents this leader issued. (The agents export their own op times as
        # timeslice_agent_op_seconds; this is the cluster-wide view, by phase.)
        self.swap_phase = Histogram("timeslice_swap_phase_seconds",
                                    "Leader: time of each swap phase (snapshot|restore) reported by agents",
                                    ["phase"], buckets=_LAT, registry=r)
        self.agent_op = self.swap_phase   # the name replica.py records with (phase = the op)
        self.grants = Counter("timeslice_grants_total", "Grants written by this replica as leader",
                              registry=r)
        # kind: "shared" (a fit group's grant made beside another holder) or "exclusive" (alone on its GPUs)
        self.grant_kinds = Counter("timeslice_grant_kinds_total",
                                   "Grants written by this replica as leader, by kind (shared | exclusive)",
                                   ["kind"], registry=r)
        self.backfilled = Counter("timeslice_backfilled_grants_total",
                                  "Fit groups: grants made before an earlier waiter that did not fit (never "
                                  "delaying it)", registry=r)
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
