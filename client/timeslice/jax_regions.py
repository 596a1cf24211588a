"""The device side of a JAX job's cooperative copies: its pytrees' arrays as spans, copied and checksummed.

A JAX array is an immutable handle to one device buffer. A tag's pytree
(``timeslice.integrations.jax.JaxMemory``) is flattened into *leaves*: each
device array becomes a ``Leaf`` (its shape, dtype, sharding and, while the
region is resident, the array); anything else in the tree (Python numbers,
NumPy arrays) is kept as it is. The backup's decisions (``timeslice.backup``)
are taken over *spans*; a leaf's span is a logical address, stable across
pauses (``(ordinal + 1) << 48`` plus the leaf's offset in its region), not the
buffer's device address: a resume makes new arrays at new addresses, and the
backup must still recognise the layout it copied. The movers translate a
logical address back to the array that holds it now.

Two movers:

* ``JaxTorchMover`` (a CUDA device with PyTorch in the process): the arrays'
  buffers are viewed as torch tensors at their device addresses
  (``unsafe_buffer_pointer``, zero copy, one CUDA context for both) and copied
  by ``torch_regions.TorchMover`` to and from the project's pinned pool
  (``timeslice.pinned``) at PCIe speed, with its checksums overlapped. A
  resume first makes the destination arrays (``jnp.zeros``), then writes them.
  ``benchmarks/gpu_jax_probe.py`` measures this path against JAX's own ones
  (``device_put`` to the ``pinned_host`` memory kind, ``device_get``).
* ``JaxHostMover`` (everything else: the CPU backend, a GPU without PyTorch):
  ``np.asarray`` copies a leaf to host memory, ``jax.device_put`` (never
  aliasing the pool) makes it again; the checksum is a jitted reduction on
  the device. On a GPU this is JAX's own transfer path: correct, slower.

The JAX checksum (``jax_checksum``): per leaf, its bytes as 32-bit words (a
narrower dtype widened word by word), their wrapping sum and their sum
weighted by an odd multiple of the position; the leaves' pairs and sizes
hashed together. A changed word changes the first, a moved one the second: a
guard against a wrong clean claim, not a cryptographic proof (as
``torch_regions`` says of its own).
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from timeslice.backup import BackupError, Extent, Span, split_extents
from timeslice.torch_regions import TorchMover

ADDR_SHIFT = 48                      # a region's logical addresses: (ordinal + 1) << 48 upward
ALIGN = 256                          # logical offsets are padded so that no two leaves' spans touch


@dataclass
class Leaf:
    """One device array of a region: what it is, and the array while the region is resident."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    nbytes: int
    array: Any = None


@dataclass
class TreeRegion:
    """One tag's pytree, flattened: its structure, its items (a ``Leaf`` or a plain value), its spans."""

    ordinal: int
    treedef: Any = None
    items: list[Any] = field(default_factory=list)
    leaves: list[Leaf] = field(default_factory=list)    # the distinct Leaf items, in order
    starts: list[int] = field(default_factory=list)     # logical start of each leaf with bytes
    spanned: list[Leaf] = field(default_factory=list)   # those leaves

    @property
    def base(self) -> int:
        return (self.ordinal + 1) << ADDR_SHIFT

    def lay_out(self) -> None:
        self.starts, self.spanned = [], []
        at = self.base
        for leaf in self.leaves:
            if leaf.nbytes:
                self.starts.append(at)
                self.spanned.append(leaf)
                at += -(-leaf.nbytes // ALIGN) * ALIGN

    def spans(self) -> list[Span]:
        return [(a, leaf.nbytes) for a, leaf in zip(self.starts, self.spanned)]

    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def locate(self, addr: int) -> tuple[Leaf, int]:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.starts[i] + self.spanned[i].nbytes:
            raise BackupError(f"logical address {addr:#x} lies in no leaf of its region")
        return self.spanned[i], addr - self.starts[i]


class HeapPool:
    """``backup.HostPool`` over ordinary (unpinned) host memory, each slab one bytearray, every page
    touched when reserved: the host backup of ``JaxHostMover`` where nothing can pin."""

    def __init__(self, slab_bytes: int = 1 << 30, on_change: Callable[[], None] | None = None):
        self.slab_bytes, self.on_change = slab_bytes, on_change
        self.admit: Callable[[int], None] | None = None    # the node's host admission (raises to refuse)
        self.slabs: list[bytearray] = []
        self._starts: list[int] = []
        self._pending = 0

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
            self.admit(nbytes)                                  # counted by the node from now, or refused: nothing taken
        self._pending = nbytes
        self._changed()
        try:
            while nbytes > 0:
                n = min(nbytes, self.slab_bytes)
                buf = bytearray(n)
                buf[::4096] = b"\1" * len(range(0, n, 4096))     # the memory is taken now, not at a pause
                self._starts.append(self.size())
                self.slabs.append(buf)
                nbytes -= n
        finally:
            self._pending = 0
            self._changed()
        return at

    def split(self, offset: int, nbytes: int) -> list[Extent]:
        return split_extents(self._starts, [len(s) for s in self.slabs], offset, nbytes)


def host_view(pool, e: Extent):
    """A writable NumPy uint8 array over one piece of a pool (bytearray slabs or pinned ones), zero copy."""
    import numpy as np
    slab = pool.slabs[e.slab]
    if isinstance(slab, (bytearray, memoryview)):
        return np.frombuffer(slab, dtype=np.uint8, count=e.nbytes, offset=e.offset)
    if getattr(slab, "addr", 0):
        return np.ctypeslib.as_array((ctypes.c_uint8 * e.nbytes).from_address(slab.addr + e.offset))
    return slab.tensor[e.offset:e.offset + e.nbytes].numpy()


_SUMS: dict[str, Any] = {}


def _words(jnp, lax, x):
    """``x``'s bytes as uint32 values, one per word of its own width (a wider dtype split in 32-bit words)."""
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.concatenate([_words(jnp, lax, jnp.real(x)), _words(jnp, lax, jnp.imag(x))])
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
    if width is None:
        raise BackupError(f"no checksum for dtype {x.dtype}")
    return lax.bitcast_convert_type(x, width).reshape(-1).astype(jnp.uint32)


def jax_checksum(jax, arrays: Sequence[Any], sizes: Sequence[int]) -> str:
    """The checksum of ``arrays`` on their device (one jitted call; compiled once per layout)."""
    fn = _SUMS.get("fn")
    if fn is None:
        jnp, lax = jax.numpy, jax.lax

        def sums(*xs):
            out = []
            for x in xs:
                w = _words(jnp, lax, x)
                i = lax.iota(jnp.uint32, w.size)
                out.append(jnp.stack([w.sum(dtype=jnp.uint32), (w * (i * jnp.uint32(2654435761) + jnp.uint32(1)))
                                      .sum(dtype=jnp.uint32)]))
            return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)
        fn = _SUMS["fn"] = jax.jit(sums)
    head = repr(list(sizes)).encode()
    if not arrays:
        return hashlib.sha256(head).hexdigest()
    import numpy as np
    got = np.asarray(jax.device_get(fn(*arrays)))
    return hashlib.sha256(head + b"jax" + got.tobytes()).hexdigest()


class _Regions:
    """Logical address -> the leaf that holds it now, over a memory's regions."""

    def __init__(self, regions: Mapping[str, TreeRegion]):
        self.regions = regions

    def spans(self, tag: str) -> list[Span]:
        r = self.regions.get(tag)
        return r.spans() if r is not None else []

    def locate(self, addr: int) -> tuple[Leaf, int]:
        ordinal = (addr >> ADDR_SHIFT) - 1
        for r in self.regions.values():
            if r.ordinal == ordinal:
                return r.locate(addr)
        raise BackupError(f"logical address {addr:#x} lies in no region")

    def arrays(self, spans: Sequence[Span]) -> list[Any]:
        out = []
        for addr, _ in spans:
            leaf, off = self.locate(addr)
            if off or leaf.array is None:
                raise BackupError(f"span {addr:#x} is not a whole resident leaf")
            out.append(leaf.array)
        return out


class JaxHostMover(_Regions):
    """``backup.Mover`` through JAX's own transfers (``np.asarray`` out, ``jax.device_put`` in)."""

    def __init__(self, jax, regions: Mapping[str, TreeRegion], pool, pace: Callable[[int, float], None] | None = None):
        super().__init__(regions)
        self.jax, self.pool, self.pace = jax, pool, pace

    def checksum(self, spans: Sequence[Span]) -> str:
        return jax_checksum(self.jax, self.arrays(spans), [n for _, n in spans])

    def to_host(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        import time

        import numpy as np
        t0, total = time.monotonic(), 0
        for (addr, n), where in zip(spans, pieces):
            leaf, _ = self.locate(addr)
            flat = np.asarray(leaf.array).reshape(-1).view(np.uint8)
            at = 0
            for e in where:
                host_view(self.pool, e)[:] = flat[at:at + e.nbytes]
                at += e.nbytes
            total += n
        if self.pace is not None:
            self.pace(total, t0)

    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        import time

        import numpy as np
        t0, total = time.monotonic(), 0
        for (addr, n), where in zip(spans, pieces):
            leaf, _ = self.locate(addr)
            views = [host_view(self.pool, e) for e in where]
            raw = views[0] if len(views) == 1 else np.concatenate(views)
            host = raw.view(leaf.dtype).reshape(leaf.shape)
            # may_alias=False: on the CPU backend device_put could otherwise keep the pool's bytes as the
            # array's buffer, and the next copy-out into that area would change a live array under the job.
            leaf.array = self.jax.device_put(host, leaf.sharding, may_alias=False)
            total += n
        self.jax.block_until_ready([self.locate(a)[0].array for a, _ in spans])
        if self.pace is not None:
            self.pace(total, t0)

    def to_host_checksum(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> tuple[str, str]:
        got = self.checksum(spans)
        self.to_host(spans, pieces)
        return got, got

    def to_device_checksum(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> str:
        self.to_device(spans, pieces)
        return self.checksum(spans)


class JaxTorchMover(TorchMover):
    """``backup.Mover`` on a CUDA device: the arrays' buffers copied by torch to the pinned pool and back."""

    def __init__(self, jax, torch, regions: Mapping[str, TreeRegion], device: int, host):
        super().__init__(torch, {}, device, host)
        self.jax, self.where = jax, _Regions(regions)

    def spans(self, tag: str) -> list[Span]:
        return self.where.spans(tag)

    def _dev(self, addr: int, nbytes: int):
        leaf, off = self.where.locate(addr)
        if leaf.array is None:
            raise BackupError(f"span {addr:#x}: its array is not on the device")
        return super()._dev(leaf.array.unsafe_buffer_pointer() + off, nbytes)

    def _make(self, spans: Sequence[Span]) -> None:
        """The destination arrays of a copy in, on the device, written by nothing else (fresh buffers)."""
        jnp = self.jax.numpy
        made = []
        for addr, _ in spans:
            leaf, _ = self.where.locate(addr)
            leaf.array = jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)
            made.append(leaf.array)
        self.jax.block_until_ready(made)              # XLA's fill is done before torch's stream writes them

    def to_device(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> None:
        self._make(spans)
        super().to_device(spans, pieces)

    def to_device_checksum(self, spans: Sequence[Span], pieces: Sequence[Sequence[Extent]]) -> str:
        self._make(spans)
        return super().to_device_checksum(spans, pieces)
