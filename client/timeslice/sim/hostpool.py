"""SIMULATED pinned host pool and copier: the CPU stand-ins for ``timeslice.pinned`` and ``torch_regions``.

A simulator, named as such: no page is pinned and no GPU is involved. What is
kept is what the cooperative backup's decisions (``timeslice.backup``) rest on:

* ``SimHostPool`` really allocates its slabs (bytearrays, every page written,
  so the host memory is taken when ``reserve`` returns), in slabs of at most
  ``slab_bytes`` (to exercise copies that must not cross a registration), at
  ``pin_gbps`` (0: as fast as it goes), and reports the bytes it has promised
  while it reserves (``pending_bytes``), calling ``on_change`` at start and end.
  ``gate``, a file path, makes a reservation wait (bounded) until the file
  exists: the tests' way to look at the node while a reservation is in
  progress. A gate file that says ``abort`` fails the reservation.
* ``SimMover`` copies between a worker's simulated device regions (bytearrays)
  and the pool, counts every copy, and checksums with SHA-256.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from timeslice.backup import BackupError, Extent, Span, split_extents

ENV_PIN_GATE = "TIMESLICE_SIM_PIN_GATE"
GATE_WAIT_S = 120.0
PAGE = 4096


class SimHostPool:
    """SIMULATOR. ``backup.HostPool`` over bytearrays."""

    def __init__(self, slab_bytes: int = 1 << 30, pin_gbps: float = 0.0, gate: str | None = None,
                 on_change: Callable[[], None] | None = None):
        if slab_bytes <= 0:
            raise ValueError("slab_bytes must be positive")
        self.slab_bytes, self.pin_bps = slab_bytes, pin_gbps * 1e9
        self.gate = gate if gate is not None else os.environ.get(ENV_PIN_GATE) or None
        self.on_change = on_change
        self.admit: Callable[[int], None] | None = None   # the node's host admission, before anything is made
        self.slabs: list[bytearray] = []
        self._starts: list[int] = []
        self._pending = 0
        self.reservations: list[tuple[float, float, int]] = []   # (start, end, bytes), monotonic

    def size(self) -> int:
        return sum(len(s) for s in self.slabs)

    def pending_bytes(self) -> int:
        return self._pending

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def reserve(self, nbytes: int) -> int:
        at = self.size()
        if nbytes <= 0:
            return at
        if self.admit is not None:
            self.admit(nbytes)                 # raises if the node cannot take it: nothing allocated
        t0 = time.monotonic()
        self._pending = nbytes
        self._changed()
        try:
            self._wait_gate()
            made = []
            left = nbytes
            while left > 0:
                n = min(left, self.slab_bytes)
                buf = bytearray(n)
                buf[::PAGE] = b"\1" * len(range(0, n, PAGE))   # touch every page: the memory is taken now
                made.append(buf)
                left -= n
            if self.pin_bps > 0:
                ahead = nbytes / self.pin_bps - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            for buf in made:
                self._starts.append(self.size())
                self.slabs.append(buf)
        finally:
            self._pending = 0
            self._changed()
        self.reservations.append((t0, time.monotonic(), nbytes))
        return at

    def _wait_gate(self) -> None:
        if not self.gate:
            return
        deadline = time.monotonic() + GATE_WAIT_S
        path = Path(self.gate)
        while not path.exists():
            if time.monotonic() > deadline:
                raise BackupError(f"simulated pin gate {self.gate} never opened")
            time.sleep(0.02)
        if path.read_text().strip() == "abort":
            raise BackupError("simulated pinning aborted (gate says abort)")

    def split(self, offset: int, nbytes: int) -> list[Extent]:
        return split_extents(self._starts, [len(s) for s in self.slabs], offset, nbytes)


class SimMover:
    """SIMULATOR. ``backup.Mover`` between tagged bytearrays ("device") and a ``SimHostPool``.

    A region's spans are its one bytearray at a made-up address (distinct per tag,
    stable while its size is): ``regions[tag]`` is None while released."""

    def __init__(self, regions: Mapping[str, bytearray | None], pool: SimHostPool,
                 pace: Callable[[int, float], None] | None = None):
        self.regions, self.pool, self.pace = regions, pool, pace
        self._addr: dict[str, int] = {}
        self.copies: list[tuple[str, int]] = []       # ("out" | "in", bytes), every copy made

    def spans(self, tag: str) -> list[Span]:
        buf = self.regions.get(tag)
        if buf is None or not len(buf):
            return []
        addr = self._addr.setdefault(tag, (len(self._addr) + 1) << 40)
        return [(addr, len(buf))]

    def _buf(self, addr: int) -> bytearray:
        for t, a in self._addr.items():
            if a == addr and self.regions.get(t) is not None:
                return self.regions[t]  # type: ignore[return-value]
        raise BackupError(f"simulated device address {addr:#x} is not mapped")

    def checksum(self, spans: Sequence[Span]) -> str:
        h = hashlib.sha256()
        for addr, n in spans:
            h.update(memoryview(self._buf(addr))[:n])
        return h.hexdigest()

    def _copy(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]], out: bool) -> None:
        t0 = time.monotonic()
        total = 0
        for (addr, _), where in zip(spans, pieces):
            dev = memoryview(self._buf(addr))
            at = 0
            for e in where:
                host = memoryview(self.pool.slabs[e.slab])[e.offset:e.offset + e.nbytes]
                if out:
                    host[:] = dev[at:at + e.nbytes]
                else:
                    dev[at:at + e.nbytes] = host
                at += e.nbytes
            total += at
        self.copies.append(("out" if out else "in", total))
        if self.pace is not None:
            self.pace(total, t0)

    def to_host(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=True)

    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=False)
