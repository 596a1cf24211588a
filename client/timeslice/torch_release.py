"""Letting go of torch-memory-saver's regions at a job's end, in a way it accepts.

What torch-memory-saver's source says (``hook_mode="torch"``, 0.0.9/0.0.10):

* a region is a PyTorch ``MemPool`` over its pluggable allocator
  (``tms_torch_malloc`` / ``tms_torch_free``), one per (tag, device, backup
  kind), kept in ``torch_memory_saver._impl._mem_pools`` for the process's life;
* ``tms_torch_free`` first checks a *thread-local* flag, "inside a region",
  that ``region()`` sets on the thread that enters it; where it is not set it
  prints ``only support interesting region ... func=tms_torch_free`` and calls
  ``exit(1)``;
* the allocator frees a region's memory only when its ``MemPool`` dies (the
  pool's destructor empties its cache of free blocks) or when
  ``empty_cache()`` runs after that; a block still in use stays mapped.

So a job that simply ends exits with status 1: at interpreter teardown the
module holding the pools is cleared on the main thread, which is not inside a
region, and the first cached block freed ends the process. (It had finished its
work; the H200 runs of the TRL job showed exactly that line, 2 runs of 2.)

Two ways out, and when each is right:

* ``release``, at ``TorchMemory.close()``: the job is inside its last hold,
  every region resident. Mark this thread as inside a region (left marked: what
  the job still holds of the regions, its model, is freed later by this
  thread), then drop the pools, so their cached blocks are freed now, through
  the check that accepts them.
* ``detach``, at exit without a close: the process may be parked, its regions
  released or the whole process checkpointed or frozen, where a device call
  blocks or faults. Touch nothing on the device: keep the pools alive past
  interpreter finalization (one reference that is never dropped), so no free
  runs through torch-memory-saver at all; the driver takes the process's device
  memory when it exits. The main thread is marked too, for any other pool.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

from timeslice.logs import get_logger

log = get_logger(__name__)


def _cdll(tms) -> Any:
    """torch-memory-saver's library handle, or None where this version keeps it elsewhere."""
    impl = getattr(tms, "_impl", None)
    return getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)


def allow_frees_here(tms) -> bool:
    """Mark the calling thread as inside a region, so ``tms_torch_free`` accepts frees made on it.

    Only allocations routed to torch-memory-saver's pools look at the mark (a plain
    allocation never reaches its allocator in torch hook mode), so leaving it set is harmless.
    Returns whether the mark could be set."""
    cdll = _cdll(tms)
    setter = getattr(cdll, "tms_set_interesting_region", None)
    if setter is None:
        return False
    setter(True)
    return True


def _owned(key, tags: Iterable[str], device: int) -> bool:
    """Whether a pool key of torch-memory-saver (tag, ..., device) or (tag, ...) or tag is one of ours."""
    if isinstance(key, tuple):
        if not key or key[0] not in tags:
            return False
        return not (len(key) >= 3 and isinstance(key[-1], int) and key[-1] != device)
    return key in tags


def take_pools(tms, tags: Iterable[str], device: int) -> list:
    """Remove our regions' pools from torch-memory-saver's table and return them (the caller decides their end)."""
    tags = set(tags)
    pools = getattr(getattr(tms, "_impl", None), "_mem_pools", None)
    if pools is None:
        return []
    taken = []
    for key in [k for k in list(pools) if _owned(k, tags, device)]:
        taken.append(pools.pop(key))
    return taken


_kept: list = []        # detached pools; each also holds one reference that finalization never drops


def keep_forever(objects: Iterable) -> int:
    """Hold ``objects`` until the process is gone: interpreter finalization never deallocates them."""
    n = 0
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        _kept.append(obj)
        n += 1
    return n
