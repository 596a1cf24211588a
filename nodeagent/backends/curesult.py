"""CUDA driver result codes that the checkpoint API returns, and their typed errors.

Shared by the driver-API backend (which gets the number) and the
``cuda-checkpoint`` backend (which only sees the tool's text, so it looks for
the ``CUDA_ERROR_*`` name or the driver's error string in it).

Numbers and strings are those of ``cuda.h`` / ``cuGetErrorString``.
"""
from __future__ import annotations

import re

from timeslice.common import device_errors as e

# code -> (name, driver's description). Only the codes the checkpoint calls and
# their callers are known to produce; anything else is reported by number.
CU_RESULTS: dict[int, tuple[str, str]] = {
    0: ("CUDA_SUCCESS", "no error"),
    1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    2: ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    4: ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
    46: ("CUDA_ERROR_DEVICES_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"),
    100: ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
    101: ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
    201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
    304: ("CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"),
    400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
    401: ("CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"),
    500: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    600: ("CUDA_ERROR_NOT_READY", "device not ready"),
    700: ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
    800: ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
    801: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
    802: ("CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"),
    803: ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"),
    999: ("CUDA_ERROR_UNKNOWN", "unknown error"),
}
_BY_NAME = {name: code for code, (name, _) in CU_RESULTS.items()}
_BY_TEXT = {text.lower(): code for code, (_, text) in CU_RESULTS.items() if code}

OUT_OF_MEMORY, NOT_INITIALIZED, OPERATING_SYSTEM, ILLEGAL_STATE, NOT_READY = 2, 3, 304, 401, 600


def name_of(code: int) -> str:
    return CU_RESULTS.get(code, (f"CUresult({code})", ""))[0]


def error_for(code: int, op: str, pid: int, detail: str = "") -> e.BackendError:
    """The typed error for a failed checkpoint call ``op`` on ``pid``.

    The mapping follows what we measured on an H200: NOT_READY is
    a lock timeout; NOT_INITIALIZED means no CUDA in that process;
    OPERATING_SYSTEM on restore means the context is lost (on other calls it is
    what a pid that does not exist gives, and callers check for that first).
    """
    name = name_of(code)
    msg = f"{op} pid {pid}: {name} ({code})" + (f": {detail}" if detail else "")
    cls: type[e.BackendError] = e.BackendError
    if code == NOT_READY:
        cls = e.LockTimeout
    elif code == NOT_INITIALIZED:
        cls = e.NoCudaContext
    elif code == OUT_OF_MEMORY:
        cls = e.DeviceOutOfMemory
    elif code == ILLEGAL_STATE:
        cls = e.IllegalState
    elif code == OPERATING_SYSTEM and op == "restore":
        cls = e.ContextLost
    return cls(msg, pid=pid, cu_result=code, cu_name=name)


_NAME_RE = re.compile(r"CUDA_ERROR_[A-Z_]+")


def code_from_text(text: str) -> int | None:
    """Find the CUresult in a tool's message: its CUDA_ERROR_* name, else its description."""
    m = _NAME_RE.search(text)
    if m and m.group(0) in _BY_NAME:
        return _BY_NAME[m.group(0)]
    low = text.lower()
    # Longest description first, so "out of memory" does not shadow a longer match.
    for desc in sorted(_BY_TEXT, key=len, reverse=True):
        if desc in low:
            return _BY_TEXT[desc]
    return None
