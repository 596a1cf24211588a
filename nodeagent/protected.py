"""Processes the agent never snapshots or restores, whoever asks.

Pid 1 (init, or a container's entrypoint), the agent itself, and the
processes of the system's own servers (etcd, lockd, another node agent):
freezing one of them would stop the machinery that unfreezes everything else.
(The agent's parent is not on the list: a test or a launcher may start an
agent and be a worker itself.) Recognised by their command line in /proc, which the agent
reads anyway (it runs with the host's pid namespace on Kubernetes).
"""
from __future__ import annotations

import os
from pathlib import Path

from timeslice.common import procfs

#: Module or program names of the system's own servers, matched against argv[0..2]'s base names.
SERVER_PROGRAMS = frozenset({"etcd", "lockd", "nodeagent", "timeslice.lockd.cli",
                             "timeslice.nodeagent.cli"})
_MAX_CMDLINE = 4096


def _argv(pid: int, proc_root: str) -> list[str]:
    try:
        with open(Path(proc_root) / str(pid) / "cmdline", "rb") as f:
            raw = f.read(_MAX_CMDLINE)
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def protected_reason(pid: int, proc_root: str = procfs.PROC_ROOT) -> str:
    """Why ``pid`` must never be acted on, or "" if nothing forbids it."""
    if pid == 1:
        return "pid 1 is init"
    if pid == os.getpid():
        return "it is the node agent itself"
    argv = _argv(pid, proc_root)
    for a in argv[:3]:
        base = os.path.basename(a)
        if base in SERVER_PROGRAMS:
            return f"it is a timeslice/etcd server ({base})"
        if a.startswith("-m") and a[2:] in SERVER_PROGRAMS:
            return f"it is a timeslice server ({a[2:]})"
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in SERVER_PROGRAMS:
        return f"it is a timeslice server ({argv[2]})"
    return ""


def scan(proc_root: str = procfs.PROC_ROOT) -> dict[int, str]:
    """Every protected process on the node now: {pid: why} (published for lockd: nodeagent/attestations.py)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            why = protected_reason(int(name), proc_root)
            if why:
                out[int(name)] = why
    return out
