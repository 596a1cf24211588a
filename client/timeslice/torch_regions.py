"""The device side of our own copies: a torch-memory-saver region's live allocations, copied and checksummed.

How a region's allocations are found. With ``hook_mode="torch"``,
torch-memory-saver 0.0.10 routes the allocations made inside
``region(tag, ...)`` to a ``torch.cuda.MemPool`` of its own, one per (tag,
backup settings, device), kept in its ``_impl._mem_pools`` (read in the
wheel's ``entrypoint.py``). PyTorch's caching allocator still books every
segment it obtains from that pool's allocator, with the pool's id
(``segment_pool_id`` in ``torch.cuda.memory._snapshot()``), and each segment
is one torch-memory-saver allocation, the unit it unmaps on pause. So the
region's live bytes are exactly the blocks of those segments that are not
``inactive``. This was chosen over tensors the job registers (it would have
to name every tensor, and one it forgot would come back as garbage) and over
diffing allocator totals (says how much, not where). A block never spans two
segments, so no copy spans two torch-memory-saver allocations either.

Device ranges are viewed as tensors through ``__cuda_array_interface__``
(zero copy), and copied with ``copy_`` to/from ``PinnedPool.view`` pieces,
each inside one registration.

The checksum is two integer reductions per span on the device (two passes
over the bytes, milliseconds for tens of GB at HBM bandwidth), combined once
for all spans (``Sums``): the sums of the span's 4 KiB rows of 64-bit words,
and the column sums of the span viewed as 512 KiB rows; then the total, the
row sums weighted by their position, and the column sums weighted by theirs
(all wrapping 64-bit). When bytes are copied anyway, the reductions run on a
side stream while the copy engine moves them (``to_host_checksum``,
``to_device_checksum``). Any change of one word changes the total; a swap of
two words changes a weighted sum; a change crafted to keep all three would
pass: a guard against a wrong "clean" promise, not a cryptographic proof.

The clean checksum (``clean_checksum``, what a clean pause runs) is the row
sums alone: one pass, half the time (16 GiB: 4.5 ms against 8.4 ms on the
H200, ``benchmarks/gpu_swap_parts``). It sees every write that changes the
sum of some 4 KiB block, or moves a block; it does not see words permuted
within one 4 KiB block, or changes within one block that cancel out. A job
that does that to a region it marked clean gets those bytes back as they were
copied. Every resume still verifies with the full checksum.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from timeslice.backup import BackupError, Extent, Span
from timeslice.pinned import PinnedPool

MAX_COLS = 1 << 16                     # words per row of the column sums: 512 KiB rows
ROW_WORDS = 512                        # words per row of the row sums: 4 KiB, the clean check's unit


class _DeviceRange:
    """A raw device range as a uint8 array, for torch.as_tensor (no copy, no ownership)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


def tms_pool(tms, tag: str, device: int):
    """The MemPool torch-memory-saver allocates ``tag``'s pool-backed region in (no CPU backup of its own)."""
    impl = getattr(tms, "_impl", None)
    pools = getattr(impl, "_mem_pools", None)
    if pools is None:
        raise BackupError("this torch-memory-saver keeps no per-region memory pools where we can find them "
                          "(hook_mode='torch' of 0.0.10 does); use TorchMemory(backup='tms')")
    for key, pool in list(pools.items()):
        if isinstance(key, tuple) and key and key[0] == tag and key[-1] == device and key[1] is False:
            return pool
    return None


def tms_region_config(tms, tag: str):
    """torch-memory-saver's per-thread region settings (tag ``tag``, interesting, no CPU backup of its own)
    without its ``use_mem_pool``: what a CUDA-graph capture into the region's pool needs (the capture
    routes the allocations to the pool itself). 0.0.10 keeps this in ``_impl._with_region_config``."""
    impl = getattr(tms, "_impl", None)
    config = getattr(impl, "_with_region_config", None)
    if config is None:
        raise BackupError("this torch-memory-saver has no per-thread region settings where we can find them "
                          "(0.0.10's _impl._with_region_config); capture the graph outside timeslice's regions")
    return config(tag=tag, enable_cpu_backup=False, cpu_backup_backend=None)


def live_spans(segments, pool_id, device: int) -> list[Span]:
    """The not-inactive blocks of ``pool_id``'s segments on ``device``, adjacent ones merged within a segment."""
    out: list[Span] = []
    want = tuple(pool_id)
    for seg in segments:
        if seg.get("device") != device or tuple(seg.get("segment_pool_id", ())) != want:
            continue
        addr = seg["address"]
        run: list[int] | None = None
        for b in seg.get("blocks", []):
            addr = b.get("address", addr)       # blocks tile their segment in address order
            live = b.get("state") != "inactive"
            if live and run is not None and run[0] + run[1] == addr:
                run[1] += b["size"]
            elif live:
                if run is not None:
                    out.append((run[0], run[1]))
                run = [addr, b["size"]]
            addr += b["size"]
        if run is not None:
            out.append((run[0], run[1]))
    out.sort()
    return out


class Sums:
    """The checksum's reductions, one or two kernels per span, combined once at the end.

    Per span viewed as 64-bit words: the sums of its rows of ``ROW_WORDS`` words and (with
    ``cols``) the column sums of it as rows of up to ``MAX_COLS`` words. At the end the row
    sums of all spans, in order, give their total and their sum weighted by position (the clean
    digest); the column sums, their sum weighted by position (added in the full digest). A span
    whose size or address is not a multiple of 8 adds its byte sum as one row. Few kernels on
    purpose: a clean pause is this checksum alone, and at tens of spans the launches cost as
    much as the passes over the bytes."""

    def __init__(self, torch, cols: bool = True):
        self.torch, self.with_cols = torch, cols
        self.rows: list = []
        self.cols: list = []

    def add(self, t) -> None:
        torch = self.torch
        n, addr = t.numel(), t.data_ptr()
        if n % 8 or addr % 8:
            self.rows.append(t.sum(dtype=torch.int64).reshape(1))
            return
        w = t.view(torch.int64)
        k = w.numel() - w.numel() % ROW_WORDS
        if k:
            self.rows.append(w[:k].view(-1, ROW_WORDS).sum(1))
        if k < w.numel():
            self.rows.append(w[k:].sum().reshape(1))
        if self.with_cols:
            cols = MAX_COLS
            while w.numel() % cols:
                cols //= 2
            self.cols.append(w.view(-1, cols).sum(0))

    def digests(self, sizes: Sequence[int]) -> tuple[str, str]:
        """(full, clean): the clean one from the row sums alone; the full one adds the columns."""
        torch = self.torch
        parts: list = []
        if self.rows:
            rows = torch.cat(self.rows)
            ri = torch.arange(rows.numel(), device=rows.device, dtype=torch.int64)
            parts = [rows.sum(), (rows * ri).sum()]
            if self.cols:
                cols = torch.cat(self.cols)
                ci = torch.arange(cols.numel(), device=cols.device, dtype=torch.int64)
                parts.append((cols * ci).sum())
        got = torch.stack(parts).tolist() if parts else []
        head = repr(list(sizes)).encode()
        clean = hashlib.sha256(head + b"rows" + repr(got[:2]).encode()).hexdigest()
        full = hashlib.sha256(head + b"full" + repr(got).encode()).hexdigest() if self.with_cols else clean
        return full, clean

    def digest(self, sizes: Sequence[int]) -> str:
        return self.digests(sizes)[0]


class TorchMover:
    """``backup.Mover`` over torch-memory-saver regions on one CUDA device."""

    def __init__(self, torch, pools: dict, device: int, host: PinnedPool):
        self.torch, self.pools, self.device, self.host = torch, pools, device, host
        self._stream = None                              # the side stream of the overlapped checksums

    def spans(self, tag: str) -> list[Span]:
        pool = self.pools.get(tag)
        if pool is None:
            return []
        return live_spans(self.torch.cuda.memory._snapshot()["segments"], pool.id, self.device)

    def _dev(self, addr: int, nbytes: int):
        return self.torch.as_tensor(_DeviceRange(addr, nbytes), device=f"cuda:{self.device}")

    def _side(self):
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(self.device)
        return self._stream

    def _copy(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]], out: bool,
              checksum: bool = False) -> tuple[str, str] | None:
        """Copy every span; with ``checksum``, reduce each span on a side stream meanwhile.

        Out: the reductions and the copy only read the span, so they run at once. In: a span's
        reduction waits for its own copy (an event), not for the later ones. Either way the
        checksum hides behind the PCIe copy instead of adding a pass after it."""
        torch = self.torch
        cur = torch.cuda.current_stream(self.device)
        side = self._side() if checksum else None
        if side is not None:
            side.wait_stream(cur)               # nothing queued before us is still writing these bytes
        sums = Sums(torch)
        for (addr, n), where in zip(spans, pieces):
            if side is not None and out:
                with torch.cuda.stream(side):
                    sums.add(self._dev(addr, n))
            at = addr
            for e in where:
                dev, host = self._dev(at, e.nbytes), self.host.view(e)
                if out:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
                at += e.nbytes
            if side is not None and not out:
                side.wait_stream(cur)           # this span's copies are in
                with torch.cuda.stream(side):
                    sums.add(self._dev(addr, n))
        if side is not None:
            with torch.cuda.stream(side):
                both = sums.digests([n for _, n in spans])
            torch.cuda.synchronize(self.device)
            return both
        torch.cuda.synchronize(self.device)
        return None

    def to_host(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=True)

    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=False)

    def to_host_checksum(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> tuple[str, str]:
        """``to_host`` and the spans' (``checksum``, ``clean_checksum``), in one overlapped pass."""
        return self._copy(spans, pieces, out=True, checksum=True) or ("", "")

    def to_device_checksum(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> str:
        """``to_device`` and the checksum of what arrived (as ``checksum`` gives it), overlapped."""
        return (self._copy(spans, pieces, out=False, checksum=True) or ("", ""))[0]

    def _sums(self, spans: Sequence[Span], cols: bool) -> tuple[str, str]:
        sums = Sums(self.torch, cols=cols)
        for addr, n in spans:
            sums.add(self._dev(addr, n))
        return sums.digests([n for _, n in spans])

    def checksum(self, spans: Sequence[Span]) -> str:
        return self._sums(spans, cols=True)[0]

    def clean_checksum(self, spans: Sequence[Span]) -> str:
        """The row sums alone: one pass (what it does not see: the module's docstring)."""
        return self._sums(spans, cols=False)[1]
