"""Swaps run promptly beside a job's CPU-bound Python: the interpreter's switch interval, lowered while one runs.

Why. A cooperative pause or resume runs on the worker's serving thread while the
job's main thread often does CPU work in Python (a reward function: exactly what
the job yielded the GPU for). A pause is hundreds of short calls that drop the
GIL (each CUDA copy, each reduction of the backup's checksum); every time one
returns, the thread must win the GIL back from the busy main thread, and CPython
hands it over only after the switch interval (5 ms by default). Measured on the
H200 (``benchmarks/results/gpu_round3_s3.md``): a 6 GB pause that takes 0.18 s with
the main thread idle took 5.1 s beside a TRL reward function, i.e. it waited for
the reward to end. On the CPU, 200 GIL-dropping calls beside a busy thread:
1.05 s at 5 ms, 0.13 s at 0.5 ms, 0.06 s at 0.1 ms
(``tests/client/test_gil.py`` shows the mechanism).

So while a swap request runs, the interval is ``SWAP_SWITCH_INTERVAL_S``; it goes
back to what it was when the request ends. The main thread loses a little time
to the extra switches, only during the swap. The interval is process-wide: if
job code changes it while a swap runs, the swap's end puts back the value from
before the swap. A main thread that holds the GIL in one long C call (no
switch points) still delays the swap; nothing short of a separate process helps there.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SWAP_SWITCH_INTERVAL_S = 50e-6

_mu = threading.Lock()
_depth = 0
_saved: float | None = None           # the interval to put back; None: it was short already, left alone


@contextlib.contextmanager
def prompt_handoff(interval_s: float = SWAP_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Lower the interpreter's switch interval for the duration (nested uses keep the outermost's value)."""
    global _depth, _saved
    with _mu:
        if _depth == 0:
            now = sys.getswitchinterval()
            _saved = now if interval_s < now else None
            if _saved is not None:
                sys.setswitchinterval(interval_s)
        _depth += 1
    try:
        yield
    finally:
        with _mu:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                sys.setswitchinterval(_saved)
