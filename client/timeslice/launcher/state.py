"""``cluster.json``: how other commands find a local cluster (endpoints, pids, backend).

Written by ``timeslice up`` (and by ``timeslice demo`` when it starts its own
cluster) into the run's folder, atomically, once everything is ready; its
``status`` turns to ``stopped`` when the cluster stops. ``find_running``
looks through ``<LOG_DIR>/*/cluster.json``, newest first, for a cluster whose
processes are still alive and whose etcd answers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

STATE_FILE = "cluster.json"
VERSION = 1


def write(path: str | os.PathLike, doc: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def candidates(log_dir: str | os.PathLike) -> list[Path]:
    """State files below ``log_dir`` (one level down), newest first."""
    root = Path(log_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"*/{STATE_FILE}") if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def is_running(doc: dict) -> bool:
    """Status ``running``, every etcd member and the agent alive and etcd healthy, a lockd replica alive."""
    from timeslice.launcher.cluster import LocalCluster
    if doc.get("status") != "running" or doc.get("version") != VERSION:
        return False
    try:
        c = LocalCluster.from_state(doc, progress=lambda _m: None)
    except (KeyError, TypeError, ValueError):
        return False
    h = c.health()
    etcd_ok = all(v for k, v in h.items() if k.startswith("etcd"))
    lockd_ok = any(v for k, v in h.items() if k.startswith("lockd"))
    agent_ok = all(v for k, v in h.items() if k.startswith("nodeagent"))
    return etcd_ok and lockd_ok and agent_ok and bool(c.etcd) and c.agent is not None


def find_running(log_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(state file, its document) of the newest running cluster under ``log_dir``, or None."""
    for path in candidates(log_dir):
        try:
            doc = read(path)
        except (OSError, ValueError):
            continue
        if is_running(doc):
            return path, doc
    return None
