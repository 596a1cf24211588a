"""A local cluster (``timeslice up``) as a job on this machine finds it: through the per-user pointers.

``timeslice up`` leaves, in a per-user folder (``$TIMESLICE_USER_STATE_DIR``, else
``$XDG_STATE_HOME/timeslice``, else ``~/.local/state/timeslice``), one pointer per
cluster to its ``cluster.json``. The launcher writes them (``timeslice.launcher.state``);
this module only reads them, without the launcher (a job imports nothing
server-side), so that a job started with what ``timeslice up`` prints finds its
node agent's socket, which lives in the cluster's run folder.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

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


def agent_socket(node: str) -> Path | None:
    """The channel socket of a running local cluster's agent for ``node``, if one listens; else None."""
    folder = pointers_dir()
    try:
        ptrs = sorted(folder.glob("*.path"), key=lambda p: p.stat().st_mtime, reverse=True)[:MAX_POINTERS]
    except OSError:
        return None
    for ptr in ptrs:
        try:
            doc = json.loads(Path(ptr.read_text().strip()).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("status") != "running" or doc.get("node") != node:
            continue
        sock = doc.get("agent_socket")
        if isinstance(sock, str) and _is_socket(sock):
            return Path(sock)
    return None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
