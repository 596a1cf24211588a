"""A local cluster (``timeslice up``) as a job or the CLI on this machine finds it: through the per-user pointers.

``timeslice up`` leaves, in a per-user folder (``$TIMESLICE_USER_STATE_DIR``, else
``$XDG_STATE_HOME/timeslice``, else ``~/.local/state/timeslice``), one pointer per
cluster to its ``cluster.json``. The launcher writes them (``timeslice.launcher.state``);
this module only reads them, without the launcher (a job imports nothing
server-side), so that a job started with what ``timeslice up`` prints finds its
node agent's socket, which lives in the cluster's run folder, and its simulated
device, and the client and the CLI find its lockd.
A cluster counts as running when its document says so and its processes are alive
(pid and start time, as the launcher recorded them).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from timeslice.common import procfs

ENV_USER_STATE_DIR = "TIMESLICE_USER_STATE_DIR"
MAX_POINTERS = 64             # clusters looked at, newest first


def user_dir() -> Path:
    """The per-user folder that holds the pointers."""
    explicit = os.environ.get(ENV_USER_STATE_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "timeslice"


def pointers_dir() -> Path:
    return user_dir() / "clusters"


def _documents():
    """(state file, document) of each pointed-to cluster whose document says running, newest first."""
    folder = pointers_dir()
    try:
        ptrs = sorted(folder.glob("*.path"), key=lambda p: p.stat().st_mtime, reverse=True)[:MAX_POINTERS]
    except OSError:
        return
    for ptr in ptrs:
        try:
            path = Path(ptr.read_text().strip())
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("status") == "running":
            yield path, doc


def _alive(proc: object) -> bool:
    if not isinstance(proc, dict) or not isinstance(proc.get("pid"), int):
        return False
    now = procfs.start_time(proc["pid"])
    return now is not None and proc.get("start_time") in (None, now)


def _processes_alive(doc: dict) -> bool:
    """Every etcd member and agent alive, and a lockd replica."""
    procs = doc.get("processes")
    if not isinstance(procs, list) or not procs:
        return False
    kinds: dict[str, list[bool]] = {}
    for p in procs:
        kinds.setdefault(str(p.get("kind") if isinstance(p, dict) else ""), []).append(_alive(p))
    return (all(kinds.get("etcd", [False])) and all(kinds.get("nodeagent", [False]))
            and any(kinds.get("lockd", [False])))


def running_cluster() -> tuple[Path, dict] | None:
    """(state file, document) of the newest running local cluster, or None."""
    for path, doc in _documents():
        if _processes_alive(doc):
            return path, doc
    return None


def agent_socket(node: str) -> Path | None:
    """The channel socket of a running local cluster's agent for ``node``, if one listens; else None."""
    for _path, doc in _documents():
        if doc.get("node") != node:
            continue
        sock = doc.get("agent_socket")
        if isinstance(sock, str) and _is_socket(sock):
            return Path(sock)
    return None


def sim_dir(node: str) -> Path | None:
    """The SIMULATED device folder of a running local cluster's agent for ``node``, if it has one; else None."""
    for _path, doc in _documents():
        if doc.get("node") != node or not _processes_alive(doc):
            continue
        sim = doc.get("sim")
        folder = sim.get("dir") if isinstance(sim, dict) else None
        if isinstance(folder, str) and folder and os.path.isdir(folder):
            return Path(folder)
    return None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
