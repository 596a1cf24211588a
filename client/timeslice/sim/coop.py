"""SIMULATED GPU memory of a cooperative worker: tagged regions of real bytes on the simulated device.

The stand-in for ``timeslice.torch_memory.TorchMemory`` on machines without a
GPU (CI, the demo). It is a simulator and says so; the semantics that matter
are kept:

* each region holds real, seeded bytes; the process's holding on the node's
  simulated device (the capacity ledger) is its "context" (a small arena,
  like a CUDA context) plus every resident region, so capacity is enforced;
* offload regions are backed up the way ``TorchMemory(backup="pool")`` does it, by
  the same decisions (``timeslice.backup.BackupBook``) over CPU stand-ins
  (``timeslice.sim.hostpool``): ``prepin`` reserves the retained host pool
  (really allocated, reported to the agent while it is being reserved), ``pause``
  copies the region into it (checksummed) unless it is clean (``mark_clean``),
  then releases the region; ``discard`` regions are dropped; ``resume`` reserves
  the capacity again (DeviceOutOfMemory if it does not fit), copies back and
  verifies; discard regions come back zeroed;
* a region must be touched only through ``compute(tag)``, which blocks while
  the agent holds the process locked (the freeze after a pause) and raises if
  the region is released — as a released torch-memory-saver page faults; a
  pause (copying device memory out) is device work too and waits likewise;
* copies are paced to ``TIMESLICE_SIM_COOP_GBPS`` (default 50 GB/s, the
  pinned PCIe figure measured on an H200: 16 GiB out in 0.34 s; 0 = unthrottled);
* the device charges what a GPU does (``timeslice.common.sim.device``): a context
  for the process and the allocator's slack on its regions and temporaries. Its
  ``DeviceStats`` (``timeslice.memstats``) are the allocator's figures (regions and
  temporaries with their slack) and the meter's (all it holds);
* ``scratch(nbytes)``: a temporary inside a hold (activations, a growing KV cache),
  real bytes; one that does not fit raises ``DeviceOutOfMemory`` as CUDA's
  out-of-memory does, after the make-room path (``timeslice.room``) asked the node
  agent to move parked residue off the device and retried.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence

from timeslice.backup import BackupBook, BackupCorrupted
from timeslice.common.device_errors import IllegalState
from timeslice.common.sim.device import device_id
from timeslice.sim.hostpool import SimHostPool, SimMover, SimPinning
from timeslice.sim.runtime import SimDeviceClient, SimStats

ENV_COOP_GBPS = "TIMESLICE_SIM_COOP_GBPS"
DEFAULT_COOP_GBPS = 50.0
DEFAULT_CONTEXT_BYTES = 1 << 20


class SimCooperativeMemory(SimStats):
    """SIMULATOR. ``regions``: tag -> (bytes, "offload" | "discard")."""

    def __init__(self, regions: Mapping[str, tuple[int, str]], sim_dir: str | os.PathLike | None = None,
                 seed: int = 0, context_bytes: int = DEFAULT_CONTEXT_BYTES, gbps: float | None = None,
                 gpu: int | None = None, *, checksum: bool = True, pinning: SimPinning | None = None,
                 resident: bool = True):
        self.tags = {t: pol for t, (_, pol) in regions.items()}
        self._size = {t: int(n) for t, (n, _) in regions.items()}
        raw = os.environ.get(ENV_COOP_GBPS)
        self.bps = (gbps if gbps is not None else float(raw) if raw else DEFAULT_COOP_GBPS) * 1e9
        self.context_bytes = context_bytes
        self.dev = SimDeviceClient.open(sim_dir, gpu)
        self.dev.alloc(context_bytes)                      # the "CUDA context": the process is on the device
        self._dev: dict[str, bytearray | None] = {}
        self._sha: dict[str, str] = {}
        self._listener = None
        pinning = pinning or SimPinning()
        self.host_pool = SimHostPool(pinning.slab_bytes, pinning.gbps, pinning.gate, on_change=self._host_changed)
        self.mover = SimMover(self._dev, self.host_pool, self._pace)
        self.book = BackupBook(self.host_pool, self.mover, checksum=checksum)
        self._seed, self._allocated = seed, False
        self._scratch: dict[int, bytearray] = {}            # temporaries of the hold, by id
        self._peak = 0                                      # the allocator's largest holding since reset_peak
        self._scratch_ids = 0
        self._room = None                                   # ask(device, bytes) -> RoomAnswer (the worker's)
        self.room_asks = 0
        self._dev.update(dict.fromkeys(self._size))
        if resident:
            self.allocate()
        else:
            self._account()

    def allocate(self) -> None:
        """Put the regions on the device, filled from the seed. ``resident=False`` defers it to here:
        like a real job, which loads its model inside its first hold (after pinning its backup)."""
        rng = random.Random(self._seed)
        fresh = {t: bytearray(rng.randbytes(n)) for t, n in self._size.items()}
        self._dev.update(fresh)
        self._account()
        self._allocated = True
        for t, buf in fresh.items():
            self._sha[t] = hashlib.sha256(buf).hexdigest()
        self._host_changed()                                # the agent learns the regions' sizes

    def allocated(self) -> bool:
        return self._allocated

    # -- what the channel asks -------------------------------------------------------
    def sim_dir(self) -> str:
        """The simulated device this memory is on (resolved): the node agent's must be the same."""
        return self.dev.root()

    def device_id(self) -> str:
        return device_id(self.dev.gpu)

    def region_bytes(self) -> dict[str, int]:
        """Device bytes per region (0 until ``allocate``: the pool is sized from the declared sizes)."""
        return {t: n if self._allocated else 0 for t, n in self._size.items()}

    def host_bytes(self) -> int:
        return self.host_pool.size()

    def host_pending_bytes(self) -> int:
        return self.host_pool.pending_bytes()

    def backup_stats(self) -> dict[str, int]:
        return dict(self.book.stats)

    def set_state_listener(self, fn) -> None:
        self._listener = fn

    def _host_changed(self) -> None:
        if self._listener is not None:
            self._listener()

    def _allocator(self) -> int:
        resident = sum(self._size[t] for t, b in self._dev.items() if b is not None)
        return self.dev.dev.allocator_bytes(resident + sum(len(b) for b in self._scratch.values()))

    # -- the hooks the cooperative worker sets ----------------------------------------------
    def set_room_maker(self, ask) -> None:
        self._room = ask

    def set_host_admission(self, admit) -> None:
        self.host_pool.admit = admit

    @contextlib.contextmanager
    def scratch(self, nbytes: int, attempts: int | None = None) -> Iterator[memoryview]:
        """A temporary of ``nbytes`` real bytes on the device for the body (inside a hold). One that does
        not fit asks the node agent for room and retries (``timeslice.room.with_room``); NoRoom (a
        DeviceOutOfMemory) names who holds the device when nothing more can be freed."""
        from timeslice.common.device_errors import DeviceOutOfMemory
        from timeslice.room import MAX_ATTEMPTS, with_room
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self._scratch_ids += 1
        key = self._scratch_ids

        def alloc() -> bytearray:
            buf = bytearray(nbytes)
            self._scratch[key] = buf
            try:
                with self.dev._device(None):
                    self._account()
            except BaseException:
                del self._scratch[key]
                raise
            return buf

        def ask(device: str, need: int):
            self.room_asks += 1
            assert self._room is not None
            return self._room(device, need)
        buf = with_room(alloc, need_bytes=nbytes, device=self.device_id(), ask=ask if self._room else None,
                        is_oom=lambda e: isinstance(e, DeviceOutOfMemory), attempts=attempts or MAX_ATTEMPTS)
        view = memoryview(buf)
        try:
            yield view
        finally:
            view.release()
            self._scratch.pop(key, None)
            self._account()                                 # freed: the allocator gives it back

    def _pace(self, nbytes: int, t0: float) -> None:
        if self.bps > 0:
            ahead = nbytes / self.bps - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def pause(self, tags: Sequence[str]) -> int:
        moved = 0
        for t in tags:
            with self.dev._device(None):                    # copying device memory is device work: waits while locked
                moved += self._pause_one(t)
        return moved

    def _pause_one(self, t: str) -> int:
        buf = self._dev.get(t)
        if buf is None:
            return 0
        moved = 0
        if self.tags[t] == "offload":
            moved = self.book.pause(t)                      # copies unless clean (the pool keeps its copy)
            self._sha[t] = hashlib.sha256(buf).hexdigest()   # what a resume must bring back
        self._dev[t] = None
        self._account()                                 # only now is the device memory released
        return moved

    def resume(self, tags: Sequence[str]) -> int:
        moved = 0
        for t in tags:
            if self._dev.get(t) is not None or not self._allocated:
                continue                                    # resident, or never put on the device: nothing to bring back
            n = self._size[t]
            self._dev[t] = bytearray(n)                     # provisional: reserve the room first
            try:
                self._account()
            except Exception:
                self._dev[t] = None
                raise
            if self.tags[t] == "offload":
                try:
                    moved += self.book.resume(t)
                except BackupCorrupted as e:
                    raise IllegalState(f"simulated region {t!r}: {e}") from None
                got = hashlib.sha256(self._dev[t]).hexdigest()   # type: ignore[arg-type]
                if self.book.checksum_on and got != self._sha[t]:
                    raise IllegalState(f"simulated region {t!r} came back corrupted ({got} != {self._sha[t]})")
            else:
                self._sha[t] = hashlib.sha256(self._dev[t]).hexdigest()  # type: ignore[arg-type]
        return moved

    def residue_bytes(self) -> int:
        """What this process still holds on the simulated device outside its resident regions: the context."""
        resident = sum(self._size[t] for t, b in self._dev.items() if b is not None)
        return max(0, self.dev.device_bytes - resident)

    def prepin(self, background: bool = False) -> None:
        """Reserve the retained host pool now, one area per offload region (the first pause would otherwise);
        ``background``: on a thread (``BackupBook.reserve``)."""
        self.book.reserve({t: n for t, n in self._size.items() if self.tags[t] == "offload"}, background=background)

    def mark_clean(self, tag: str) -> None:
        """The job's promise: region ``tag`` is not written until ``mark_dirty`` (``timeslice.backup``)."""
        self.book.mark_clean(tag)

    def mark_dirty(self, tag: str) -> None:
        self.book.mark_dirty(tag)

    # -- what the job does -----------------------------------------------------------
    @contextlib.contextmanager
    def compute(self, tag: str, timeout_s: float | None = None) -> Iterator[memoryview]:
        """A device operation on region ``tag``: blocks while the agent froze the process,
        raises IllegalState if the region is released (a stray call outside a hold)."""
        with self.dev._device(timeout_s):
            buf = self._dev.get(tag)
            if buf is None:
                raise IllegalState(f"simulated device: region {tag!r} is released (touched outside a hold; "
                                   "on a GPU this is a sticky illegal-address error)", pid=self.dev.pid)
            view = memoryview(buf)
            try:
                yield view
            finally:
                view.release()

    def checksum(self, tag: str, timeout_s: float | None = None) -> str:
        with self.compute(tag, timeout_s) as mem:
            return hashlib.sha256(mem).hexdigest()

    def expected(self, tag: str) -> str:
        """The checksum the region must have: as last written through ``write``, as copied
        by the last pause (offload), or as recreated (discard)."""
        return self._sha[tag]

    def write(self, tag: str, data: bytes, offset: int = 0) -> None:
        """Change a region's bytes (inside a hold), keeping the expected checksum in step."""
        with self.compute(tag) as mem:
            mem[offset:offset + len(data)] = data
            self._sha[tag] = hashlib.sha256(mem).hexdigest()

    def close(self) -> None:
        self._dev = {t: None for t in self._dev}
        self.dev.close()
