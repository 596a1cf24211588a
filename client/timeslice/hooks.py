"""The hooks around a hold: release the framework's cached device memory before a yield; cap the
framework's allocator at a fit group's admitted footprint while holding.

(The user's ``before_yield`` / ``after_acquire`` hooks run where usercode.py says.)

Every byte a framework keeps cached on the GPU is a byte the node agent must
copy out when the job is snapshotted. PyTorch's caching allocator keeps freed
blocks; ``torch.cuda.empty_cache()`` returns them to the driver. The hook never
imports torch: it acts only when the job has already imported it *and*
initialised CUDA, so a CPU-only job pays nothing and no CUDA context is
created by accident.
"""
from __future__ import annotations

import sys

from timeslice.logs import get_logger

log = get_logger(__name__)


def release_framework_cache() -> bool:
    """Synchronise and empty torch's CUDA cache when torch is loaded and CUDA is up.

    Returns True when it did something. Errors are logged, never raised: a
    failed cache release costs bytes, not correctness.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return False
        cuda.synchronize()
        cuda.empty_cache()
        return True
    except Exception as e:  # best effort by design
        log.warning("cache_release_failed", error=str(e))
        return False



_cap = {"bytes": 0}          # the cap set last in this process (0: none), for the out-of-memory account


def current_cap() -> int:
    """Bytes torch's allocator is capped at now by ``cap_allocator`` (0: not capped)."""
    return _cap["bytes"]


def cap_allocator(footprint: dict, exclusive: bool, node: str) -> int | None:
    """Cap torch's caching allocator on the current CUDA device at what a fit group's grant admitted
    there (``footprint``: ``"<node>/<GPU index>"`` -> bytes), so that a job outgrowing its declared
    peak fails in its own process (``torch.OutOfMemoryError``) instead of taking a co-holder's memory.
    An exclusive grant (or one without a footprint: every exclusive group's) lifts the cap. Returns the
    cap set (0: lifted), None when nothing was done: torch not loaded or CUDA not up (the call never
    initialises CUDA), or the grant spans several GPUs of the node (no mapping from the agent's GPU
    indexes to torch's devices is assumed)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        mine = [int(b) for where, b in footprint.items() if str(where).rpartition("/")[0] == node]
        if exclusive or not mine:
            cuda.set_per_process_memory_fraction(1.0)
            _cap["bytes"] = 0
            return 0
        if len(mine) != 1:
            log.info("allocator_cap_skipped", why="the grant spans several GPUs of this node", gpus=len(mine))
            return None
        total = cuda.get_device_properties(cuda.current_device()).total_memory
        cuda.set_per_process_memory_fraction(min(1.0, mine[0] / total))
        _cap["bytes"] = mine[0]
        log.info("allocator_capped", cap_bytes=mine[0], device_bytes=total)
        return mine[0]
    except Exception as e:  # best effort: the planner's admission stands without it
        log.warning("allocator_cap_failed", error=str(e))
        return None
