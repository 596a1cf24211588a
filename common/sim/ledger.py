"""The simulated devices' capacity ledger, shared by every process on the node.

SIMULATOR. ``ledger.json`` holds the number of simulated GPUs, the capacity of
each, the bytes each pid holds and on which GPU (``where``; a process holds
its bytes on one GPU, as a worker bound to one device does); every
read-modify-write happens under an exclusive ``fcntl.flock`` on
``ledger.lock``, so workers allocating and the agent restoring cannot together
oversubscribe a GPU. Entries are *set*, not added to, which makes a repeated
reservation (an agent redoing a restore after a crash) harmless. A ledger
written before GPUs were counted reads as one GPU, every pid on GPU 0.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from timeslice.common.device_errors import DeviceOutOfMemory, IllegalState
from timeslice.common.files import atomic_write_json


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
            doc.setdefault("where", {})
            before = json.dumps(doc, sort_keys=True)
            yield doc
            if json.dumps(doc, sort_keys=True) != before:
                atomic_write_json(self.path, doc)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def ensure(self, capacity: int | None, default_capacity: int, gpus: int | None = None,
               default_gpus: int = 1) -> tuple[int, int]:
        """Create the ledger if absent; set capacity (per GPU) and GPU count if given.

        Returns (capacity per GPU, number of GPUs).
        """
        with self._locked() as doc:
            if capacity is not None:
                doc["capacity"] = int(capacity)
            elif not doc["capacity"]:
                doc["capacity"] = int(default_capacity)
            if gpus is not None:
                doc["gpus"] = int(gpus)
            elif "gpus" not in doc:
                doc["gpus"] = int(default_gpus)
            return doc["capacity"], doc["gpus"]

    def ensure_model(self, context_bytes: int | None, slack: float | None,
                     defaults: Callable[[int], tuple[int, float]]) -> tuple[int, float]:
        """The device's charges per process (SIMULATED: a context, the allocator's slack), set if
        given, else kept, else ``defaults(capacity)``. Returns (context bytes, slack fraction)."""
        with self._locked() as doc:
            d_ctx, d_slack = defaults(int(doc["capacity"]))
            if context_bytes is not None:
                doc["context_bytes"] = int(context_bytes)
            elif "context_bytes" not in doc:
                doc["context_bytes"] = int(d_ctx)
            if slack is not None:
                doc["slack"] = float(slack)
            elif "slack" not in doc:
                doc["slack"] = float(d_slack)
            return int(doc["context_bytes"]), float(doc["slack"])

    def reserve(self, pid: int, nbytes: int, is_dead: Callable[[int], bool], gpu: int = 0) -> None:
        """Set ``pid``'s holding on GPU ``gpu`` to ``nbytes``, or raise DeviceOutOfMemory.

        Holdings of dead processes are dropped first, as the driver frees the
        memory of a process that exits. Only the pids on the same GPU compete.
        """
        with self._locked() as doc:
            alloc, where = doc["alloc"], doc["where"]
            if not 0 <= gpu < doc.get("gpus", 1):
                raise IllegalState(f"simulated device: no GPU {gpu} (this node has {doc.get('gpus', 1)})",
                                   pid=pid, cu_result=101, cu_name="CUDA_ERROR_INVALID_DEVICE")
            for p in [p for p in alloc if is_dead(int(p))]:
                del alloc[p]
                where.pop(p, None)
            others = sum(v for p, v in alloc.items() if int(p) != pid and where.get(p, 0) == gpu)
            if others + nbytes > doc["capacity"]:
                raise DeviceOutOfMemory(
                    f"simulated device: {nbytes} bytes for pid {pid} do not fit on GPU {gpu} "
                    f"({doc['capacity'] - others} of {doc['capacity']} free)",
                    pid=pid, cu_result=2, cu_name="CUDA_ERROR_OUT_OF_MEMORY")
            alloc[str(pid)] = int(nbytes)
            where[str(pid)] = int(gpu)

    def release(self, pid: int) -> None:
        with self._locked() as doc:
            doc["alloc"].pop(str(pid), None)
            doc["where"].pop(str(pid), None)

    def snapshot(self) -> tuple[int, dict[int, int]]:
        """(capacity per GPU, {pid: bytes})."""
        with self._locked() as doc:
            return doc["capacity"], {int(p): v for p, v in doc["alloc"].items()}

    def layout(self) -> tuple[int, int, dict[int, tuple[int, int]]]:
        """(capacity per GPU, number of GPUs, {pid: (gpu, bytes)})."""
        with self._locked() as doc:
            where = doc["where"]
            return doc["capacity"], doc.get("gpus", 1), {int(p): (int(where.get(p, 0)), v)
                                                  for p, v in doc["alloc"].items()}
