"""Why the planner writes an intent, in words for the log: which job needs how many bytes where, what is free.

Sans-IO and advisory: the text travels with the intent (``plan.WriteIntent.reason``), is logged by the
scheduler's ``intent`` event, and decides nothing.
"""
from __future__ import annotations

from collections.abc import Iterable


def size_text(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def room_text(job: str, node: str, need: dict[int, int] | None, free: dict[int, int], gpus: Iterable[int],
              margin: int) -> str:
    """Which job needs how many bytes on which GPUs of ``node``, and what is free there."""
    gpus = sorted(gpus)
    if need is None:
        return (f"job {job}'s footprint is unknown (no device_bytes_hint, nothing measured yet): room is made "
                f"on {node} GPU {','.join(map(str, gpus)) or '?'}")
    parts = [f"GPU {g}: needs {size_text(need.get(g, 0))}, {size_text(free.get(g, 0))} free" for g in gpus]
    return f"job {job} on {node}: " + "; ".join(parts) + (f" (margin {size_text(margin)})" if margin else "")
