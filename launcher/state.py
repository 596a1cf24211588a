"""``cluster.json``: how other commands find a local cluster (endpoints, pids, backend).

Written by ``timeslice up`` (and by ``timeslice demo`` when it starts its own
cluster) into the run's folder, atomically, once everything is ready; its
``status`` turns to ``stopped`` when the cluster stops. ``find_running``
looks through ``<LOG_DIR>/*/cluster.json``, newest first, for a cluster whose
processes are still alive and whose etcd answers.

So that other commands find the cluster from any directory, ``remember``
also leaves a pointer to the state file in a per-user folder
(``$TIMESLICE_USER_STATE_DIR``, else ``$XDG_STATE_HOME/timeslice``, else
``~/.local/state/timeslice``, spelled in ``timeslice.common.local``, which jobs read to find
their node agent's socket); ``find_running_anywhere`` looks there first.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from timeslice.common.local import pointers_dir
from timeslice.common.local import user_dir as user_dir  # the job side reads the pointers too (timeslice.common.local)
from timeslice.launcher.etcd import probe_healthy
from timeslice.launcher.procs import Child

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


def children(doc: dict) -> tuple[list[Child], list[Child], list[Child]]:
    """(etcd members, lockd replicas, agents) of a state document, as handles on their pids."""
    out: dict[str, list[Child]] = {"etcd": [], "lockd": [], "nodeagent": []}
    for p in doc["processes"]:
        out["etcd" if p["kind"] == "etcd" else "lockd" if p["kind"] == "lockd" else "nodeagent"].append(
            Child.from_dict(p))
    return out["etcd"], out["lockd"], out["nodeagent"]


def is_running(doc: dict) -> bool:
    """Status ``running``, every etcd member and the agent alive and etcd healthy, a lockd replica alive."""
    if doc.get("status") != "running" or doc.get("version") != VERSION:
        return False
    try:
        etcd, lockd, agents = children(doc)
    except (KeyError, TypeError, ValueError):
        return False
    etcd_ok = all(m.alive() and probe_healthy(m) is not None for m in etcd)
    lockd_ok = any(r.alive() for r in lockd)
    agent_ok = all(a.alive() for a in agents)
    return etcd_ok and lockd_ok and agent_ok and bool(etcd) and bool(agents)


def find_running(log_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(state file, its document) of the newest running cluster under ``log_dir``, or None."""
    return _first_running(candidates(log_dir))


def _first_running(paths: list[Path]) -> tuple[Path, dict] | None:
    for path in dict.fromkeys(paths):           # each once, in order
        try:
            doc = read(path)
        except (OSError, ValueError):
            continue
        if is_running(doc):
            return path, doc
    return None


# -- per-user pointers ----------------------------------------------------------------------------

def _pointer(state_path: Path) -> Path:
    digest = hashlib.sha256(str(state_path).encode()).hexdigest()[:16]
    return pointers_dir() / f"{digest}.path"


def remember(state_path: str | os.PathLike) -> None:
    """Leave a pointer to ``state_path`` in the per-user folder (best effort: never fails a start)."""
    path = Path(state_path).absolute()
    try:
        ptr = _pointer(path)
        ptr.parent.mkdir(parents=True, exist_ok=True)
        tmp = ptr.with_suffix(".tmp")
        tmp.write_text(str(path) + "\n")
        os.replace(tmp, ptr)
    except OSError:
        pass


def forget(state_path: str | os.PathLike) -> None:
    try:
        _pointer(Path(state_path).absolute()).unlink()
    except OSError:
        pass


def remembered() -> list[Path]:
    """State files the per-user folder points to, newest pointer first; dangling pointers are dropped."""
    folder = pointers_dir()
    if not folder.is_dir():
        return []
    out = []
    for ptr in sorted(folder.glob("*.path"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            target = Path(ptr.read_text().strip())
        except OSError:
            continue
        if target.is_file():
            out.append(target)
        else:
            ptr.unlink(missing_ok=True)
    return out


def find_running_anywhere(log_dir: str | os.PathLike | None = None) -> tuple[Path, dict] | None:
    """Like ``find_running``, over the per-user pointers first, then ``log_dir``."""
    return _first_running(remembered() + (candidates(log_dir) if log_dir is not None else []))
