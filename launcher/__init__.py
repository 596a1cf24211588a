"""The local single-machine cluster behind ``timeslice up`` and ``timeslice demo``.

``settings`` reads ``deploy/local.env`` (flags override it); ``cluster`` is
the handle on a running cluster (addresses, health, stop) and ``start`` its
start sequence; ``state`` writes and finds ``cluster.json``.

The processes themselves are the building blocks that the test harness
(``timeslice.testing``), the benchmarks and the chaos scenarios start too, adding
their fault injection on top: ``procs.Child`` (spawn detached with a log file,
wait until ready, stop, kill), ``etcd.EtcdMember``, ``servers.LockdReplica``
and ``servers.NodeAgent`` (each builds its own command line), and ``pids``
(which process a pid is, signalling it and its group). Nothing here imports
the test harness.
"""
from timeslice.launcher.cluster import (
           DEFAULT_GROUP,
           LaunchError,
           LocalCluster,
           Progress,
)
from timeslice.launcher.settings import Settings, SettingsError, load
from timeslice.launcher.state import find_running

__all__ = [
           "DEFAULT_GROUP",
           "LaunchError",
           "LocalCluster",
           "Progress",
           "Settings",
           "SettingsError",
           "find_running",
           "load",
]
