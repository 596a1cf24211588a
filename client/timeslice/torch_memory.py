"""Cooperative swap memory on torch-memory-saver: tagged regions a job allocates its tensors in.

    memory = TorchMemory({"weights": "offload", "optimizer": "offload", "kv_cache": "discard"},
                         host_bytes={"weights": 40 << 30})      # sizes known up front: pinned at cooperate
    client.cooperate(memory)                                    # before the first acquire: pins the backup
    with client.on_accelerators("g"):
        with memory.region("weights"):
            model = build_model().cuda()
        memory.mark_clean("weights")                            # a sampler: weights change only at sync

torch-memory-saver (the library SGLang, slime and veRL use between RL phases)
backs the tensors of a region with physical pages it can unmap and map again
at the same virtual addresses. It runs in-process with ``hook_mode="torch"``
(a PyTorch pluggable allocator; no LD_PRELOAD).

Two ways to keep an ``offload`` region's bytes while it is paused:

* ``backup="pool"``: torch-memory-saver only unmaps (its regions are made
  without a CPU backup); before a pause we copy the region's live allocations
  into our own pinned pool (``timeslice.pinned``: 14.4 GB/s to pin on the
  H200, 5x torch's ``pin_memory``), after a resume back
  (``timeslice.torch_regions`` says how the allocations are found). The pool
  is reserved by ``prepin`` (``cooperate`` calls it) from ``host_bytes`` and
  the regions' sizes, and kept for the process lifetime. Clean regions
  (``mark_clean``, ``timeslice.backup`` for the exact promise) are not copied
  out again; with ``checksum`` on (default) a wrong promise is caught and the
  region copied after all, and every resume is verified.
* ``backup="tms"``: torch-memory-saver's own pinned backup (cudaMallocHost,
  with ``retain_cpu_backup``), allocated by the first pause or by ``prepin``
  (one pause and resume: device work, so that prepin must run inside a hold).
  Pinning that way took 24-28 s for 40 GiB and stalls the process's own GPU
  work while it runs. ``mark_clean`` is accepted and does nothing.

``backup="auto"`` (default) is ``pool`` where this torch-memory-saver exposes
its per-region pools, else ``tms``.

After a pause, what the process still holds on the device outside its regions
(its CUDA context, the allocator's cache, cuBLAS workspaces, any tensor made
outside a region) is its *residue*: ``residue_bytes()`` measures it, from
NVML's per-process figure where the driver shows this process, else from the
allocator's own count (which cannot see the context).

Its ``DeviceStats`` (``timeslice.memstats``: torch's allocator peak and reservation on
its device, NVML's figure for the process) are what the client measures at each yield
for the footprint its grants admit. ``with_room(fn)`` runs a step that may allocate
past the hold's room: on torch's out-of-memory error it asks the node agent to move
parked jobs' residue off the GPU and runs the step again (``timeslice.room``: torch's
allocator has no hook that retries an allocation itself). A pinned pool is admitted by
the node agent before it is made (``set_host_admission``, which the worker sets).

At the job's end, ``close()`` (inside its last hold; ``TimeSlice.finish`` calls
it) releases the regions the way torch-memory-saver accepts; a process that
exits without it detaches them instead, touching nothing on the device, so the
job exits with its own status either way (``timeslice.torch_release`` says why).

PyTorch and torch-memory-saver are imported here only: the lock never needs them.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import structlog

from timeslice import teardown, torch_release
from timeslice.backup import BackupBook, BackupError
from timeslice.cooperative import DISCARD, OFFLOAD, POLICIES

log = structlog.get_logger(__name__)

DEFAULT_TAGS = {"weights": OFFLOAD, "optimizer": OFFLOAD, "kv_cache": DISCARD}
BACKUPS = ("auto", "pool", "tms")


class TorchMemory:
    """Tagged torch-memory-saver regions on one CUDA device, with retained pinned backups."""

    def __init__(self, tags: Mapping[str, str] | None = None, device: int | None = None,
                 retain_backup: bool = True, *, backup: str = "auto", host_bytes: Mapping[str, int] | None = None,
                 checksum: bool = True, pin_method: str = "auto", pin_threads: int | None = None):
        import torch
        from torch_memory_saver import torch_memory_saver as tms
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
        self.tags = dict(DEFAULT_TAGS if tags is None else tags)
        for tag, policy in self.tags.items():
            if policy not in POLICIES:
                raise ValueError(f"tag {tag!r}: policy must be one of {POLICIES}, got {policy!r}")
        unknown = sorted(set(host_bytes or {}) - {t for t, p in self.tags.items() if p == OFFLOAD})
        if unknown:
            raise ValueError(f"host_bytes names tags that are not offload regions: {unknown}")
        self._torch, self._tms = torch, tms
        try:
            tms.hook_mode = "torch"        # in-process allocator; must be set before first use
        except (AssertionError, AttributeError):
            pass                           # already initialised by the job itself: keep its choice
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.retain_backup = retain_backup
        self._retain_set = False
        self._bytes = {t: 0 for t in self.tags}
        self._paused: set[str] = set()
        self._declared = {t: int(n) for t, n in (host_bytes or {}).items()}
        self._pinned = False
        self._pools: dict = {}
        self.book: BackupBook | None = None
        self.backup = self._choose(backup)
        if self.backup == "pool":
            from timeslice.pinned import PinnedPool
            from timeslice.torch_regions import TorchMover
            self.host_pool = PinnedPool(pin_method, pin_threads, on_change=self._host_changed)
            self.book = BackupBook(self.host_pool, TorchMover(torch, self._pools, self.device, self.host_pool),
                                   checksum=checksum)
        self._listener: Callable[[], None] | None = None
        self._room: Callable | None = None               # ask(device, bytes) -> RoomAnswer (the worker's)
        self.room_asks = 0                               # room requests made (benchmarks count them)
        self._admit: Callable[[int], None] | None = None  # the node agent's host admission
        self._mu = threading.Lock()                 # close (the job's thread) against a swap (the channel's)
        self._closed = False
        teardown.on_exit(self._at_exit)

    def _choose(self, backup: str) -> str:
        if backup == "tms":
            return "tms"
        try:
            self._tms._ensure_initialized()        # our regions need its pools: see torch_regions
            ok = hasattr(self._tms._impl, "_mem_pools") and hasattr(self._torch.cuda.memory, "_snapshot")
        except Exception as e:                      # an unknown torch-memory-saver: its own backup then
            ok, why = False, str(e)
        else:
            why = "" if ok else "torch-memory-saver keeps no per-region pools we can read"
        if not ok and backup == "pool":
            raise BackupError(f"backup='pool' is not possible here: {why}")
        if not ok:
            log.info("torch_memory_backup", backup="tms", why=why)
        return "pool" if ok else "tms"

    def set_state_listener(self, fn: Callable[[], None] | None) -> None:
        """Called when what the node agent should know changes: a host reservation starts or ends,
        a region grows (the cooperative worker sends it its state)."""
        self._listener = fn

    def _host_changed(self) -> None:
        if self._listener is not None:
            self._listener()

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Allocate the tensors made inside this block in region ``tag``."""
        if tag not in self.tags:
            raise ValueError(f"unknown tag {tag!r}; declared: {sorted(self.tags)}")
        self._check_open("region()")
        torch = self._torch
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        own_backup = self.tags[tag] == OFFLOAD and self.backup == "tms"
        with self._tms.region(tag=tag, enable_cpu_backup=own_backup):
            yield
        torch.cuda.synchronize(self.device)
        grown = max(torch.cuda.memory_reserved(self.device) - before,
                    free_before - torch.cuda.mem_get_info(self.device)[0])
        self._bytes[tag] += max(0, grown)
        if self.backup == "pool" and tag not in self._pools:
            from timeslice.torch_regions import tms_pool
            pool = tms_pool(self._tms, tag, self.device)
            if pool is None and grown > 0:
                raise BackupError(f"region {tag!r} allocated {grown} bytes but its memory pool was not found")
            if pool is not None:
                self._pools[tag] = pool
        if self.backup == "tms" and self.retain_backup and not self._retain_set:
            self._tms.retain_cpu_backup = True
            self._retain_set = True
        if grown > 0:
            self._host_changed()                        # the agent learns the region's size now

    @contextlib.contextmanager
    def graph(self, tag: str, cuda_graph, stream=None) -> Iterator[None]:
        """Capture ``cuda_graph`` (``torch.cuda.CUDAGraph``) with every buffer it allocates in discard
        region ``tag``: the capture uses the region's own memory pool, so a pause releases the graph's
        memory too, and a resume maps new pages at the same addresses, which keeps the graph's
        pointers valid (``timeslice.integrations.dense`` says why that holds). Discard only: what a
        graph's buffers hold is rewritten by its next replay. Allocate nothing else in ``tag`` after
        a capture (a block the graph freed could be handed to it while the graph still writes it)."""
        if self.tags.get(tag) != DISCARD:
            raise ValueError(f"a graph's memory goes in a discard region; {tag!r} is {self.tags.get(tag)!r}")
        from timeslice.torch_regions import tms_pool, tms_region_config
        torch = self._torch
        with self.region(tag):                  # the region's pool exists after this (tms makes it on first use)
            pool = tms_pool(self._tms, tag, self.device)
        if pool is None:
            raise BackupError(f"region {tag!r}: torch-memory-saver's memory pool was not found")
        if self.backup == "pool":
            self._pools.setdefault(tag, pool)
        # Not inside region(): tms's region already routes this thread's allocations to the pool, and a
        # capture that routes them there again is refused ("beginAllocateToPool: already recording to
        # mempool_id", the H200 run in benchmarks/results/gpu_round4.md). The capture routes them to the
        # pool itself; tms only needs to know the tag (its allocator books each allocation under it).
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # thread_local: another thread of this process (the pinning of a backup, the channel) may make
        # calls a global capture would refuse; the capture refuses only this thread's.
        with tms_region_config(self._tms, tag), \
                torch.cuda.graph(cuda_graph, pool=pool.id, stream=stream, capture_error_mode="thread_local"):
            yield
        torch.cuda.synchronize(self.device)
        self._bytes[tag] += max(0, torch.cuda.memory_reserved(self.device) - before,
                                free_before - torch.cuda.mem_get_info(self.device)[0])

    def device_id(self) -> str:
        uuid = str(self._torch.cuda.get_device_properties(self.device).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def region_bytes(self) -> dict[str, int]:
        return dict(self._bytes)

    def host_bytes(self) -> int:
        """Pinned host backup kept between swaps (the pool; or tms's, allocated by the first pause or prepin)."""
        if self.backup == "pool":
            return self.host_pool.size()
        if not (self._pinned and self.retain_backup):
            return 0
        return sum(n for t, n in self._bytes.items() if self.tags[t] == OFFLOAD)

    def host_pending_bytes(self) -> int:
        """Host bytes a reservation in progress has promised and not pinned yet."""
        return self.host_pool.pending_bytes() if self.backup == "pool" else 0

    def backup_stats(self) -> dict[str, int]:
        return dict(self.book.stats) if self.book is not None else {}

    # -- clean regions (see timeslice.backup for the promise) ----------------------------
    def mark_clean(self, tag: str) -> None:
        """Promise: region ``tag`` is not written from now until ``mark_dirty(tag)``."""
        self._offload(tag)
        if self.book is not None:
            self.book.mark_clean(tag)

    def mark_dirty(self, tag: str) -> None:
        self._offload(tag)
        if self.book is not None:
            self.book.mark_dirty(tag)

    @contextlib.contextmanager
    def writing(self, tag: str) -> Iterator[None]:
        """``mark_dirty`` before the block (a weight sync), ``mark_clean`` after."""
        self.mark_dirty(tag)
        yield
        self.mark_clean(tag)

    def _offload(self, tag: str) -> None:
        if self.tags.get(tag) != OFFLOAD:
            raise ValueError(f"{tag!r} is not an offload region; declared: {self.tags}")

    # -- swaps ---------------------------------------------------------------------------
    def _each(self, fn, tags: Sequence[str]) -> None:
        torch = self._torch
        torch.cuda.set_device(self.device)          # this runs on the channel's thread
        torch.cuda.synchronize(self.device)          # nothing of ours may still use the pages
        for t in tags:
            fn(t)
        torch.cuda.synchronize(self.device)

    def pause(self, tags: Sequence[str]) -> int | None:
        """Release ``tags``; returns the bytes copied to the host (None: torch-memory-saver's own count)."""
        with self._mu:
            self._check_open("pause")
            return self._pause(tags)

    def _pause(self, tags: Sequence[str]) -> int | None:
        if self.book is None:
            self._each(self._tms.pause, tags)
            self._paused.update(tags)
            if any(self.tags[t] == OFFLOAD for t in tags):
                self._pinned = True
            return None
        book, moved = self.book, 0

        def one(t: str) -> None:
            nonlocal moved
            if self.tags[t] == OFFLOAD:
                moved += book.pause(t)
            self._tms.pause(t)
        self._each(one, tags)
        self._paused.update(tags)
        return moved

    def resume(self, tags: Sequence[str]) -> int | None:
        with self._mu:
            self._check_open("resume")
            return self._resume(tags)

    def _resume(self, tags: Sequence[str]) -> int | None:
        if self.book is None:
            self._each(self._tms.resume, tags)
            self._paused.difference_update(tags)
            return None
        book, moved = self.book, 0

        def one(t: str) -> None:
            nonlocal moved
            self._tms.resume(t)
            if self.tags[t] == OFFLOAD:
                moved += book.resume(t)
        self._each(one, tags)
        self._paused.difference_update(tags)
        return moved

    def declare(self, tag: str, nbytes: int) -> None:
        """Offload region ``tag`` will hold about ``nbytes`` (e.g. an optimizer's state before its first
        step): ``prepin`` reserves at least that much host backup for it (like ``host_bytes``)."""
        if self.tags.get(tag) != OFFLOAD:
            raise ValueError(f"{tag!r} is not an offload region")
        self._declared[tag] = max(self._declared.get(tag, 0), int(nbytes))

    def prepin(self, tags: Sequence[str] | None = None, background: bool = False) -> None:
        """Reserve the retained host backups now, of the offload regions ``tags`` (default all).

        ``pool``: pins ``max(host_bytes or declared, live bytes)`` per offload region, no device work, so it
        may run before the first hold (``cooperate`` calls it); ``background``: on a thread, so that it
        overlaps the job's start-up (``BackupBook.reserve``; a pause waits for it). ``tms``: one pause
        and resume of every offload region (device work: call it while holding the group; never in
        the background)."""
        offload = [t for t, p in self.tags.items() if p == OFFLOAD and (tags is None or t in tags)]
        if self.book is not None:
            # Live bytes, not the region's segments: a pause copies only live blocks, and an optimizer's
            # first step leaves cached segments of its temporaries in the region (a 7B AdamW step:
            # 15.7 GB of them, pinned for nothing inside the first train hold on the H200).
            live = {t: sum(n for _, n in self.book.mover.spans(t)) for t in offload}
            self.book.reserve({t: max(self._declared.get(t, 0), live[t]) for t in offload}, background=background)
            return
        offload = [t for t in offload if self._bytes[t]]
        if offload:
            if self._admit is not None:
                # torch-memory-saver pins its own backup in the pause: the node admits it first.
                self._admit(sum(self._bytes[t] for t in offload) - self.host_bytes())
            self.pause(offload)
            self.resume(offload)

    # -- the end -------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"TorchMemory is closed (the job ended its regions): no {what} after close()")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The job is done with its regions: release them, in the way torch-memory-saver accepts.

        Call it inside the job's last hold, every region resident (``TimeSlice.finish`` does).
        The pools' cached blocks go back to the device now; what the job still holds of the
        regions (its model) stays readable and is freed by this thread later. After it, no
        region, pause or resume. Idempotent."""
        with self._mu:
            if self._closed:
                return
            if self._paused:
                raise RuntimeError(f"close() needs every region resident (call it inside a hold); "
                                   f"released now: {sorted(self._paused)}")
            self._torch.cuda.synchronize(self.device)
            marked = torch_release.allow_frees_here(self._tms)
            pools = self._take_pools()
            self._closed = True
            n = len(pools)
            del pools                     # the pools' destructors free their cached blocks, on this thread
            log.info("torch_memory_released", pools=n, thread_marked=marked)

    def _take_pools(self) -> list:
        taken = torch_release.take_pools(self._tms, self.tags, self.device)
        seen = {id(p) for p in taken}
        taken += [p for p in self._pools.values() if id(p) not in seen]
        self._pools.clear()
        return taken

    def _at_exit(self) -> None:
        """At interpreter exit (after the clients closed): detach what close() did not release."""
        with self._mu:
            if not self._closed:
                kept = torch_release.keep_forever(self._take_pools())
                self._closed = True
                log.info("torch_memory_detached", pools=kept, paused=sorted(self._paused))
            torch_release.allow_frees_here(self._tms)

    # -- what stays behind -------------------------------------------------------------
    def residue_bytes(self) -> int:
        """Device bytes this process holds outside its resident regions (after a full pause: all it keeps)."""
        resident = sum(n for t, n in self._bytes.items() if t not in self._paused)
        used = self._process_bytes()
        if used is not None:
            return max(0, used - resident)
        # The allocator counts a region's segments as reserved even while torch-memory-saver
        # has unmapped them, so every region comes off; the CUDA context is not counted at all.
        return max(0, self._torch.cuda.memory_reserved(self.device) - sum(self._bytes.values()))

    # -- DeviceStats (timeslice.memstats) -------------------------------------------------
    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.device)

    def allocator_peak_bytes(self) -> int:
        return int(self._torch.cuda.max_memory_reserved(self.device))

    def allocator_bytes(self) -> int:
        return int(self._torch.cuda.memory_reserved(self.device))

    def device_used_bytes(self) -> int | None:
        return self._process_bytes()

    # -- room and host admission (the cooperative worker sets the hooks) -------------------
    def set_room_maker(self, ask: Callable) -> None:
        self._room = ask

    def set_host_admission(self, admit: Callable[[int], None]) -> None:
        self._admit = admit
        if self.backup == "pool":
            self.host_pool.admit = admit

    def with_room(self, fn: Callable, *args, attempts: int | None = None, **kwargs):
        """``fn(*args, **kwargs)``; on torch's out-of-memory error, room is asked of the node agent (parked
        jobs' residue moved off this GPU) and ``fn`` runs again, at most ``attempts`` times in all. Only
        for a step that may be redone (a generation, a forward pass). Raises torch's OutOfMemoryError,
        naming what holds the device, once nothing more can be freed."""
        from timeslice.room import MAX_ATTEMPTS, with_room
        torch = self._torch

        def raise_as(msg: str, err: BaseException, answer) -> BaseException:
            return torch.OutOfMemoryError(msg)

        room = self._room

        def ask(device: str, need: int):
            self.room_asks += 1
            assert room is not None
            return room(device, need)
        return with_room(lambda: fn(*args, **kwargs), need_bytes=0, device=self.device_id(),
                         ask=ask if room is not None else None,
                         is_oom=lambda e: isinstance(e, torch.OutOfMemoryError), attempts=attempts or MAX_ATTEMPTS,
                         before_retry=lambda: torch.cuda.empty_cache(), raise_as=raise_as)

    def peak_bytes(self) -> int:
        """The most this job has needed on the device (allocator peak plus what torch cannot see)."""
        cuda = self._torch.cuda
        used = self._process_bytes()
        outside = 0 if used is None else max(0, used - cuda.memory_reserved(self.device))
        return cuda.max_memory_reserved(self.device) + outside

    def _process_bytes(self) -> int | None:
        """This process's device memory as NVML shows it; None where it cannot (no NVML, another pid namespace)."""
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByUUID(self.device_id())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except Exception:  # best effort: the allocator's count stands in
            return None
        return None
