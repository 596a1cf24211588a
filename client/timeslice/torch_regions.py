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

The checksum is three integer reductions per span on the device (about two
passes over the bytes, milliseconds for tens of GB at HBM bandwidth): the
span as rows of 64-bit words; the sum of the row sums, the row sums weighted
by row index, and the column sums weighted by column index (all wrapping
64-bit). Any change of one word changes the total; a swap of two words
changes a weighted sum; a change crafted to keep all three would pass: a
guard against a wrong "clean" promise, not a cryptographic proof.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from timeslice.backup import BackupError, Extent, Span
from timeslice.pinned import PinnedPool

MAX_COLS = 1 << 16                     # words per row: 512 KiB rows


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


class TorchMover:
    """``backup.Mover`` over torch-memory-saver regions on one CUDA device."""

    def __init__(self, torch, pools: dict, device: int, host: PinnedPool):
        self.torch, self.pools, self.device, self.host = torch, pools, device, host

    def spans(self, tag: str) -> list[Span]:
        pool = self.pools.get(tag)
        if pool is None:
            return []
        return live_spans(self.torch.cuda.memory._snapshot()["segments"], pool.id, self.device)

    def _dev(self, addr: int, nbytes: int):
        return self.torch.as_tensor(_DeviceRange(addr, nbytes), device=f"cuda:{self.device}")

    def _copy(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]], out: bool) -> None:
        torch = self.torch
        for (addr, _), where in zip(spans, pieces):
            at = addr
            for e in where:
                dev, host = self._dev(at, e.nbytes), self.host.view(e)
                if out:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
                at += e.nbytes
        torch.cuda.synchronize(self.device)

    def to_host(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=True)

    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._copy(spans, pieces, out=False)

    def checksum(self, spans: Sequence[Span]) -> str:
        torch = self.torch
        parts = []
        for addr, n in spans:
            t = self._dev(addr, n)
            if n % 8 or addr % 8:
                parts.append(t.sum(dtype=torch.int64).reshape(1))
                continue
            w = t.view(torch.int64)
            cols = MAX_COLS
            while w.numel() % cols:
                cols //= 2
            m = w.view(-1, cols)
            rows = m.sum(1)
            colsum = m.sum(0)
            ri = torch.arange(rows.numel(), device=w.device, dtype=torch.int64)
            ci = torch.arange(cols, device=w.device, dtype=torch.int64)
            parts.append(torch.stack([rows.sum(), (rows * ri).sum(), (colsum * ci).sum()]))
        if not parts:
            return hashlib.sha256(b"").hexdigest()
        vals = torch.cat(parts).tolist()
        h = hashlib.sha256()
        h.update(repr([n for _, n in spans]).encode())
        h.update(repr(vals).encode())
        return h.hexdigest()
