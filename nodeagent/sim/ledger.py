"""The simulated device's capacity ledger, shared by every process on the node.

SIMULATOR. ``ledger.json`` holds the device's capacity and the bytes each pid
holds on it; every read-modify-write happens under an exclusive ``fcntl.flock``
on ``ledger.lock``, so workers allocating and the agent restoring cannot
together oversubscribe the device. Entries are *set*, not added to, which makes
a repeated reservation (an agent redoing a restore after a crash) harmless.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from nodeagent.backends.errors import DeviceOutOfMemory
from nodeagent.backends.records import atomic_write_json


class Ledger:
    def __init__(self, root: Path):
        self.path = root / "ledger.json"
        self.lock_path = root / "ledger.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            doc = json.loads(self.path.read_text()) if self.path.exists() else {}
            doc.setdefault("capacity", 0)
            doc.setdefault("alloc", {})
            before = json.dumps(doc, sort_keys=True)
            yield doc
            if json.dumps(doc, sort_keys=True) != before:
                atomic_write_json(self.path, doc)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def ensure(self, capacity: int | None, default_capacity: int) -> int:
        """Create the ledger if absent; set the capacity if one is given. Returns it."""
        with self._locked() as doc:
            if capacity is not None:
                doc["capacity"] = int(capacity)
            elif not doc["capacity"]:
                doc["capacity"] = int(default_capacity)
            return doc["capacity"]

    def reserve(self, pid: int, nbytes: int, is_dead: Callable[[int], bool]) -> None:
        """Set ``pid``'s holding to ``nbytes``, or raise DeviceOutOfMemory.

        Holdings of dead processes are dropped first, as the driver frees the
        memory of a process that exits.
        """
        with self._locked() as doc:
            alloc = doc["alloc"]
            for p in [p for p in alloc if is_dead(int(p))]:
                del alloc[p]
            others = sum(v for p, v in alloc.items() if int(p) != pid)
            if others + nbytes > doc["capacity"]:
                raise DeviceOutOfMemory(
                    f"simulated device: {nbytes} bytes for pid {pid} do not fit "
                    f"({doc['capacity'] - others} of {doc['capacity']} free)",
                    pid=pid, cu_result=2, cu_name="CUDA_ERROR_OUT_OF_MEMORY")
            alloc[str(pid)] = int(nbytes)

    def release(self, pid: int) -> None:
        with self._locked() as doc:
            doc["alloc"].pop(str(pid), None)

    def snapshot(self) -> tuple[int, dict[int, int]]:
        """(capacity, {pid: bytes})."""
        with self._locked() as doc:
            return doc["capacity"], {int(p): v for p, v in doc["alloc"].items()}
