"""Retained host backups that the job copies itself: where each region's bytes go, and when a copy is skipped.

The decisions of a cooperative pause/resume, kept apart from the bytes: a
``Mover`` (``torch_regions.TorchMover`` on a GPU, the simulator's in
``timeslice.sim.coop``) lists a region's live device spans, checksums them and
copies them; a ``HostPool`` (``pinned.PinnedPool``, or the simulator's CPU
stand-in) is host memory made of *slabs*, each one registration. This module
decides what goes where and whether a pause copies at all.

Layout. ``reserve(sizes)`` gives every offload region its own *area* of the
pool (logical ranges, so one region's re-layout never moves another's copy).
A copy-out lays the region's spans into its area in order; a piece never
crosses a slab (a single host<->device copy spanning two separately
registered ranges fails with cudaErrorInvalidValue on the H200), nor an area.
A region that outgrew its area gets a new slab at that pause (pinned then:
logged as ``pinned_pool_grown``; size regions up front to avoid it).

Clean regions. ``mark_clean(tag)`` is the job's promise: *from now until
``mark_dirty(tag)`` it does not write the region* (``with writing(tag):`` does
both around a weight sync). The promise is sticky across swaps: a sampler
says it once after loading (or after each sync), a frozen LoRA base once for
good. A pause skips the copy-out when the promise holds since the last copy
(the pool's copy was taken, or put back, under this same promise) and the
region's spans are the ones that copy was made from; the device pages are
released and the pool keeps its copy. The first pause under a new promise
copies (the pool holds older bytes).

A wrong promise. With ``checksum`` on (the default: a reduction over the
region at HBM bandwidth, milliseconds for tens of GB), every copy-out records
the checksum of what it copied; a clean pause checksums the device and, if it
differs, copies out after all (``clean_mismatches`` counts it, a warning
``clean_claim_wrong`` says so); every resume checksums what it put back and
raises ``BackupCorrupted`` if it is not what was copied. With ``checksum``
off the job's word is taken: a region written under a promise comes back, at
the next resume, as it was when the pool last copied it.

Two checksums where the mover has both. The clean pause is the checksum and
the release alone, so it uses the mover's ``clean_checksum`` when it has one:
one pass over the bytes instead of two (on the H200, 4.5 ms instead of 8.4 ms
for 16 GiB). What that one pass misses is the mover's to say
(``torch_regions``: bytes moved or changed within one 4 KiB block so that the
block's sum stays the same); every copy-out records both checksums at once,
and every resume still verifies with the full one (it overlaps the copy in,
so it costs nothing there).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

Span = tuple[int, int]                   # (device address, bytes): one live range of a region


class BackupError(RuntimeError):
    """The retained backup cannot do what was asked (root of this module's errors)."""


class BackupCorrupted(BackupError):
    """What a resume put back is not what the last copy-out took."""


@dataclass(frozen=True)
class Extent:
    """Host bytes inside one slab (one registration): a copy may target it as a whole."""

    slab: int
    offset: int
    nbytes: int


def split_extents(starts: Sequence[int], sizes: Sequence[int], offset: int, nbytes: int) -> list[Extent]:
    """``[offset, offset+nbytes)`` of a pool made of slabs (slab ``i`` starts at ``starts[i]`` and
    holds ``sizes[i]`` bytes) as pieces that each lie in one slab: a copy never crosses a
    registration. One rule for the pinned pool and the simulated one."""
    out = []
    i = 0
    while nbytes > 0:
        while i + 1 < len(starts) and starts[i + 1] <= offset:
            i += 1
        if i >= len(sizes) or offset >= starts[i] + sizes[i]:
            raise BackupError(f"pool range {offset}+{nbytes} lies beyond its {sum(sizes)} bytes")
        off = offset - starts[i]
        k = min(nbytes, sizes[i] - off)
        out.append(Extent(i, off, k))
        offset, nbytes = offset + k, nbytes - k
    return out


class HostPool(Protocol):
    def size(self) -> int: ...                                   # logical bytes reserved (all slabs)
    def pending_bytes(self) -> int: ...                          # promised, not reserved yet
    def reserve(self, nbytes: int) -> int: ...                   # more room; returns its logical offset
    def split(self, offset: int, nbytes: int) -> list[Extent]: ...  # cut at slab boundaries


class Mover(Protocol):
    def spans(self, tag: str) -> list[Span]: ...
    def checksum(self, spans: Sequence[Span]) -> str: ...
    def to_host(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None: ...
    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None: ...
    # Optional: to_device_checksum (the copy and ``checksum`` of the same bytes in one overlapped
    # pass); clean_checksum (one cheaper pass, for clean pauses); to_host_checksum (the copy
    # and, overlapped, (``checksum``, ``clean_checksum``) of what it copied). Used where a mover has them.


@dataclass
class _Region:
    areas: list[tuple[int, int]] = field(default_factory=list)   # logical (offset, bytes) owned
    layout: tuple[Span, ...] | None = None                       # spans the pool's copy was taken from
    pieces: list[list[Extent]] = field(default_factory=list)     # where each of those spans lies
    checksum: str | None = None                                  # of the bytes as copied
    clean_sum: str | None = None                                 # the mover's clean_checksum of them
    copy_epoch: int = -1                                         # the promise in force when copied
    epoch: int = 0
    claim: int | None = None                                     # epoch of the standing promise

    def room(self) -> int:
        return sum(n for _, n in self.areas)


INTERLEAVE_S = 0.05                      # between a background reservation's regions (see _reserve_behind)
STAT_KEYS = ("copies_out", "bytes_out", "copies_in", "bytes_in", "clean_skips", "clean_mismatches",
             "verified", "pool_grown")


class BackupBook:
    """Per offload region: its area of the pool, the layout and checksum of its copy, its promise."""

    def __init__(self, pool: HostPool, mover: Mover, checksum: bool = True, grow_min_bytes: int = 64 << 20):
        self.pool, self.mover, self.checksum_on = pool, mover, checksum
        self.grow_min_bytes = grow_min_bytes
        self._regions: dict[str, _Region] = {}
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self._pinning: threading.Thread | None = None      # a reservation running in the background
        self._pinning_for: dict[str, int] = {}              # the sizes it will have given
        self._pinning_error: BaseException | None = None
        self._pinned_tags: set[str] = set()                 # the regions whose area it has made
        self._pinned_cv = threading.Condition()
        self.pin_waited_s = 0.0                             # pauses and resumes waited for it, in all

    def _r(self, tag: str) -> _Region:
        return self._regions.setdefault(tag, _Region())

    # -- room --------------------------------------------------------------------------
    def reserve(self, sizes: Mapping[str, int], background: bool = False) -> int:
        """Give each region at least ``sizes[tag]`` bytes of area, in one reservation. Returns bytes added.

        ``background``: on a thread of its own, returning at once (0), one region after the other in
        the order given (put the one a first pause needs first: the weights; an optimizer's state
        exists only after the first step), so that a first pin overlaps the job's start-up (model
        build, first generate) instead of delaying it: seconds on a warm host, more on a freshly
        started one, where the first touch of host memory bounds it. A pause or resume of a region
        waits until that region's area is there; a reservation the one in flight does not cover
        waits for all of it (``settle``); a failure of it is raised there."""
        if background:
            self.settle()
            want = {t: n for t, n in sizes.items() if n > self._r(t).room()}
            if not want:
                return 0
            self._pinning_for, self._pinning_error, self._pinned_tags = want, None, set()
            self._pinning = threading.Thread(target=self._reserve_behind, args=(want,), daemon=True,
                                             name="timeslice-prepin")
            self._pinning.start()
            return 0
        if self._pinning is not None and all(n <= max(self._pinning_for.get(t, 0), self._r(t).room())
                                             for t, n in sizes.items()):
            return 0                          # the reservation in flight covers it: no need to wait here
        self.settle()
        return self._reserve(sizes)

    def _reserve_behind(self, sizes: dict[str, int]) -> None:
        try:
            for i, (t, n) in enumerate(sizes.items()):
                if i:
                    # Let another process's reservation waiting on the host's pinning lock go first: N jobs
                    # started together then pin every job's first region (what its first pause needs)
                    # before anyone's second, instead of one job's whole backup after the other's.
                    time.sleep(INTERLEAVE_S)
                self._reserve({t: n})
                with self._pinned_cv:
                    self._pinned_tags.add(t)
                    self._pinned_cv.notify_all()
        except BaseException as e:            # kept for settle(): a pause must not go on without room
            self._pinning_error = e
            log.warning("pinned_pool_background_failed", error=str(e)[:300], bytes=sum(sizes.values()))
        finally:
            with self._pinned_cv:
                self._pinned_cv.notify_all()

    def settle(self, tag: str | None = None) -> None:
        """Wait for a background reservation to end (``tag``: only until that region's area is there);
        raise its failure (once) if it failed. The time waited adds up in ``pin_waited_s``."""
        t = self._pinning
        if t is None:
            return
        t0 = time.monotonic()
        if tag is not None and tag in self._pinning_for:
            with self._pinned_cv:
                self._pinned_cv.wait_for(lambda: tag in self._pinned_tags or not t.is_alive())
            if tag in self._pinned_tags:
                self.pin_waited_s += time.monotonic() - t0
                return
        elif tag is not None:
            return                            # not one of the reservation's regions: nothing to wait for
        t.join()
        self.pin_waited_s += time.monotonic() - t0
        self._pinning, self._pinning_for = None, {}
        err, self._pinning_error = self._pinning_error, None
        if err is not None:
            raise BackupError(f"the host backup could not be reserved: {err}") from err

    def pinning(self) -> bool:
        """A background reservation is still running."""
        return self._pinning is not None and self._pinning.is_alive()

    def _reserve(self, sizes: Mapping[str, int]) -> int:
        short = {t: n - self._r(t).room() for t, n in sizes.items() if n > self._r(t).room()}
        total = sum(short.values())
        if total <= 0:
            return 0
        at = self.pool.reserve(total)
        for t, n in short.items():
            self._r(t).areas.append((at, n))
            at += n
        return total

    def _grow(self, tag: str, need: int) -> None:
        self.settle()                          # one reservation at a time on the pool
        extra = max(need, self.grow_min_bytes)
        at = self.pool.reserve(extra)
        self._r(tag).areas.append((at, extra))
        self.stats["pool_grown"] += 1
        log.warning("pinned_pool_grown", tag=tag, bytes=extra, hint="size the region up front (prepin) so "
                    "that no swap pins host memory")

    def _place(self, r: _Region, spans: Sequence[Span]) -> list[list[Extent]]:
        out: list[list[Extent]] = []
        areas = iter(r.areas)
        at, left = next(areas, (0, 0))
        for _, n in spans:
            pieces: list[Extent] = []
            while n > 0:
                while left == 0:
                    at, left = next(areas)
                k = min(n, left)
                pieces.extend(self.pool.split(at, k))
                at, left, n = at + k, left - k, n - k
            out.append(pieces)
        return out

    # -- the job's word ------------------------------------------------------------------
    def mark_clean(self, tag: str) -> None:
        r = self._r(tag)
        r.epoch += 1
        r.claim = r.epoch

    def mark_dirty(self, tag: str) -> None:
        self._r(tag).claim = None

    @contextlib.contextmanager
    def writing(self, tag: str) -> Iterator[None]:
        self.mark_dirty(tag)
        yield
        self.mark_clean(tag)

    def is_clean(self, tag: str) -> bool:
        r = self._regions.get(tag)
        return bool(r and r.claim is not None)

    # -- swaps ---------------------------------------------------------------------------
    def pause(self, tag: str) -> int:
        """Bring the pool's copy of ``tag`` up to date (before its device pages go). Returns bytes copied."""
        self.settle(tag)
        r = self._r(tag)
        spans = tuple(self.mover.spans(tag))
        quick = getattr(self.mover, "clean_checksum", None)
        now: str | None = None                         # the full checksum of the device, where known
        if r.claim is not None and r.claim == r.copy_epoch and r.layout == spans and r.layout is not None:
            if not self.checksum_on:
                self.stats["clean_skips"] += 1
                return 0
            if quick is not None:
                seen = quick(spans)
            else:
                seen = now = self.mover.checksum(spans)
            if seen == r.clean_sum:
                self.stats["clean_skips"] += 1
                return 0
            self.stats["clean_mismatches"] += 1
            log.warning("clean_claim_wrong", tag=tag, bytes=sum(n for _, n in spans),
                        action="copied out after all; the region was written while marked clean")
        total = sum(n for _, n in spans)
        if total > r.room():
            self._grow(tag, total - r.room())
        pieces = r.pieces if spans == r.layout else self._place(r, spans)
        need = self.checksum_on and now is None
        both = getattr(self.mover, "to_host_checksum", None) if need else None   # copy and checksums overlapped
        clean: str | None = now
        if both is not None:
            now, clean = both(spans, pieces)
        else:
            if need:
                now = self.mover.checksum(spans)
                clean = quick(spans) if quick is not None else now
            self.mover.to_host(spans, pieces)
        r.layout, r.pieces, r.checksum, r.clean_sum = spans, pieces, now, clean
        r.copy_epoch = -1 if r.claim is None else r.claim
        self.stats["copies_out"] += 1
        self.stats["bytes_out"] += total
        return total

    def resume(self, tag: str) -> int:
        """Put the pool's copy of ``tag`` back (its device pages are mapped again). Returns bytes copied."""
        self.settle(tag)
        r = self._regions.get(tag)
        if r is None or r.layout is None:
            return 0                                   # never copied out: nothing of it to bring back
        spans = tuple(self.mover.spans(tag))
        if spans != r.layout:
            raise BackupError(f"region {tag!r}: its device spans changed while paused "
                              f"({len(r.layout)} copied, {len(spans)} now); its backup cannot be put back")
        want = r.checksum if self.checksum_on else None
        both = getattr(self.mover, "to_device_checksum", None) if want is not None else None
        if both is not None:
            got = both(spans, r.pieces)
        else:
            self.mover.to_device(spans, r.pieces)
            got = self.mover.checksum(spans) if want is not None else ""
        total = sum(n for _, n in spans)
        self.stats["copies_in"] += 1
        self.stats["bytes_in"] += total
        if want is not None:
            if got != want:
                raise BackupCorrupted(f"region {tag!r} came back different from what its last pause copied "
                                      f"({got[:16]} != {want[:16]})")
            self.stats["verified"] += 1
        return total
