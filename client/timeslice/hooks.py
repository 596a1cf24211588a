"""The hook around a yield: release the framework's cached device memory.

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

