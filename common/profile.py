"""The figures of one job's profile in one group: the record lockd derives and the CLI reads.

lockd builds them from its hold history (``timeslice.lockd.profiles``) and sends them in
GetProfiles; ``timeslice profile`` and ``timeslice advise`` read them back (the client's
``timeslice.advise.profile``), and a profile file carries the same fields. One record,
so a figure added on one side is there on the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SAMPLE_LISTS = ("hold_ms", "gap_ms", "wait_ms", "snapshot_ms", "restore_ms", "swap_bytes", "busy_ms")


@dataclass
class ProfileFigures:
    job: str
    group: str
    hold_ms: list[int] = field(default_factory=list)          # grant to release, as the leader saw them
    gap_ms: list[int] = field(default_factory=list)           # release to the next enqueue: its CPU phase
    wait_ms: list[int] = field(default_factory=list)          # enqueue to grant: queueing and swaps
    snapshot_ms: list[int] = field(default_factory=list)
    restore_ms: list[int] = field(default_factory=list)
    swap_bytes: list[int] = field(default_factory=list)
    busy_ms: list[int] = field(default_factory=list)          # the job's own measure of its holds
    gpu_bytes: dict[str, int] = field(default_factory=dict)   # "<node>/<device>" -> peak bytes
    device_bytes: int = 0
    host_bytes: int = 0
    peak_bytes: int = 0                                       # the largest allocator peak it reported
    context_bytes: int = 0                                    # the most it held outside its allocator
    residue_bytes: int = 0                                    # the most a pause of it left on the devices
    grants: int = 0
    elided: int = 0
    restored: int = 0
    updated_ms: int = 0
