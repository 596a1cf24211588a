"""How the launcher talks to the person who started it: timestamped progress lines, sizes, clipped text."""
from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Timestamped progress lines ("[ 1.2s] lockd r0: ready at 127.0.0.1:40123")."""

    def __init__(self, out: Callable[[str], None] | None = None):
        self.t0 = time.monotonic()
        self._out = out or (lambda s: print(s, flush=True))

    def __call__(self, msg: str) -> None:
        self._out(f"  [{time.monotonic() - self.t0:5.1f}s] {msg}")


def size_text(n: int) -> str:
    """``64 MiB``, ``1.5 GiB``: a byte count as a person reads it."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."
