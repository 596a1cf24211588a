"""Busy time: the union of intervals and the duty cycle over a window.

The one definition of GPU busy time that the advisor (``timeslice.advise``), the operator
report, the demo and the benchmarks measure with, so their figures compare.
"""
from __future__ import annotations


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once): the GPU's busy time."""
    total = 0.0
    current: tuple[float, float] | None = None
    for s, e in sorted(intervals):
        if current is None or s > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (s, e)
        else:
            current = (current[0], max(current[1], e))
    if current is not None:
        total += current[1] - current[0]
    return total


def duty(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Duty cycle over [lo, hi]: the busy share of that window."""
    if hi <= lo:
        return 0.0
    clipped = [(max(lo, s), min(hi, e)) for s, e in intervals if e > lo and s < hi]
    return union_length(clipped) / (hi - lo)
