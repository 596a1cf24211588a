"""The local single-machine cluster behind ``timeslice up`` and ``timeslice demo``.

``settings`` reads ``deploy/local.env`` (flags override it), ``cluster``
starts and stops etcd, the lockd replicas and the node agent, ``state``
writes and finds ``cluster.json``, ``procs`` runs the child processes.
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
