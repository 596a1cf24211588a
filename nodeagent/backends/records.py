"""Durable records of what was checkpointed, per process, for the real CUDA backends.

After a checkpoint the device no longer shows the process (its context is
gone), yet a restore must know how many bytes it will need on which GPU
*before* it starts. So the size is measured just before the checkpoint and
written here; an agent that restarts reads it back and never forgets a
snapshotted job's size.

One small JSON file per pid, written atomically (temp file + rename + fsync),
keyed by (pid, start time) so that a record of a process that died, and whose
pid was reused, is recognised as stale and dropped.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from timeslice.common import procfs
from timeslice.common.files import atomic_write_json

ENV_STATE_DIR = "TIMESLICE_AGENT_STATE_DIR"
DEFAULT_STATE_DIR = "/var/lib/timeslice/nodeagent"


class SnapshotRecords:
    """``<dir>/snap-<pid>.json``: {pid, start_time, usage{device: bytes}, at}."""

    def __init__(self, directory: str | os.PathLike | None = None, proc_root: str = procfs.PROC_ROOT):
        self.dir = Path(directory or os.environ.get(ENV_STATE_DIR) or DEFAULT_STATE_DIR)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc_root = proc_root

    def _path(self, pid: int) -> Path:
        return self.dir / f"snap-{pid}.json"

    def put(self, pid: int, usage: Mapping[str, int]) -> None:
        doc = {"pid": pid, "start_time": procfs.start_time(pid, self.proc_root),
               "usage": dict(usage), "at": time.time()}
        atomic_write_json(self._path(pid), doc)

    def get(self, pid: int) -> dict[str, int] | None:
        """The recorded per-device usage of this incarnation of ``pid``, or None."""
        try:
            doc = json.loads(self._path(pid).read_text())
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return None
        if not procfs.same_process(pid, doc.get("start_time"), self.proc_root):
            # The process died (or the pid now belongs to another one): its
            # snapshot died with it. Drop the record so it cannot mislead.
            self.drop(pid)
            return None
        return {str(k): int(v) for k, v in doc.get("usage", {}).items()}

    def drop(self, pid: int) -> None:
        try:
            self._path(pid).unlink()
        except FileNotFoundError:
            pass

    def pids(self) -> list[int]:
        """Pids with a record (stale ones included; ``get`` filters them)."""
        out = []
        for p in self.dir.glob("snap-*.json"):
            try:
                out.append(int(p.stem.split("-", 1)[1]))
            except ValueError:
                continue
        return sorted(out)
