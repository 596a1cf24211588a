"""What every component's metrics registry shares: buckets, build info, process metrics.

Conventions (checked by tests/test_metrics_logs.py): every name starts
with ``timeslice_``; lockd's names carry no component infix, the agent's carry
``agent_``; durations end in ``_seconds``, sizes in ``_bytes``, ratios in
``_ratio``, counters in ``_total``; one meaning has one name (lockd does not
re-export the agents' op times: it exports the swap split by phase).
"""
from __future__ import annotations

import platform

from prometheus_client import (
    CollectorRegistry,
    Info,
    ProcessCollector,
    disable_created_metrics,
)

from timeslice.common.version import __version__

# Waits and swaps: from a local handoff (ms) to the longest acquire a job may
# wait (600 s, the client's default deadline) and beyond.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                   300, 600, 1200)


def add_common(registry: CollectorRegistry, component: str) -> None:
    """``timeslice_build_info`` and the ``process_*`` metrics, in ``registry``."""
    # No ``*_created`` series: in the text format they read as extra gauges,
    # doubling every counter and histogram for no use on a dashboard.
    disable_created_metrics()
    info = Info("timeslice_build", "Version of the running program", registry=registry)
    info.info({"version": __version__, "component": component, "python": platform.python_version()})
    ProcessCollector(registry=registry)
