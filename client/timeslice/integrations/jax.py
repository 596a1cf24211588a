"""Cooperative swap memory for JAX: the pytrees a job names, moved to host memory at a pause and made again at a resume.

    memory = JaxMemory({"params": "offload", "opt_state": "offload", "cache": "discard"})   # before JAX's GPU starts
    memory.declare("params", jax.eval_shape(init, key))        # sizes known before the arrays exist
    worker = client.cooperate(memory)                          # before the first hold: pinning is host work
    with client.on_accelerators("rl-gpus"):
        memory["params"] = init(key)                           # the memory owns the tree from now on
    with client.on_accelerators("rl-gpus"):
        params = memory["params"]                              # read it again in every hold
        params, loss = step(params, batch)
        memory["params"] = params

Why the job reads its state through the memory. A JAX array is an immutable
handle to one device buffer, and the job holds such handles everywhere. At a
pause the memory copies a tag's arrays to host memory and deletes them
(``Array.delete``: the buffer goes back at once, whoever else refers to it);
at a resume it makes new arrays from the copy. So the tree to use after a hold
began is ``memory[tag]``; a reference kept from before the pause raises JAX's
own "Array has been deleted" when used, and reading a paused tag (a phase run
outside its hold) raises ``RegionReleased``. Neither can compute on stale or
missing bytes.

The project's promises, kept as for torch (``timeslice.torch_memory``):

* the host backup is reserved once (``prepin``, which ``cooperate`` calls; from
  ``declare``'s sizes when the arrays do not exist yet) and kept between pauses;
  on a CUDA device with PyTorch in the process it is the project's pinned pool
  and the copies run at PCIe speed (``timeslice.jax_regions``; ``backup="pool"``),
  elsewhere ordinary host memory through JAX's own transfers (``backup="host"``);
* clean trees are not copied again, and no promise is needed for it: arrays are
  immutable, so a tag whose tree was not replaced (``memory[tag] = ...``) since its
  last copy still matches the host copy; every such skip is checked against the
  checksum of that copy (``timeslice.backup``), and every resume is verified;
* the node agent resumes the memory before the grant, and a failed resume fails
  the acquire with its reason: nobody runs with its state not back.

Freed memory must really leave the device. By JAX's default a GPU process takes
75% of the device at its start, and with preallocation off XLA's pool still keeps
what was freed (measured on the H200: deleting 16 GiB left NVML unchanged). With
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``
a deleted array's memory goes back to the driver. ``JaxMemory`` sets both (where
the job has not) when it is made before JAX's backends start (``allocator=None``
leaves them alone), and warns where they came too late.

What stays behind is reported. After each pause the memory measures the device
bytes the process keeps outside its resident regions (``residue_bytes``: NVML's
figure for this process, else XLA's count) for the cooperative worker to report;
at the first pause it lists the live arrays outside the named trees
(``jax.live_arrays``) in a warning and in ``left_behind``: how many, how large.

JAX is imported here only, when a ``JaxMemory`` is made: the lock never needs it.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from timeslice.backup import BackupBook, BackupError
from timeslice.common.device_errors import IllegalState
from timeslice.cooperative import OFFLOAD, POLICIES
from timeslice.jax_regions import Leaf, TreeRegion
from timeslice.logs import get_logger

log = get_logger(__name__)

DEFAULT_TAGS = {"params": OFFLOAD, "opt_state": OFFLOAD}
BACKUPS = ("auto", "pool", "host")
PREALLOCATE, ALLOCATOR = "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"
LARGEST = 5                       # arrays named in the left-behind report
SAMPLE_S = 0.02                   # how often a hold's device holding is read (NVML) for its peak


class RegionReleased(IllegalState):
    """A paused tag was read or written: device work outside a hold."""


def returning_allocator() -> bool:
    """Make XLA give freed device memory back to the driver, if its backends have not started yet
    (each variable only where the job has not set it). Returns whether both are in force."""
    import jax
    started = True
    with contextlib.suppress(Exception):           # a JAX without the probe: assume started, change nothing
        from jax._src import xla_bridge
        started = xla_bridge.backends_are_initialized()
    if not started:
        os.environ.setdefault(PREALLOCATE, "false")
        os.environ.setdefault(ALLOCATOR, "platform")
    del jax
    return (os.environ.get(PREALLOCATE, "").lower() in ("false", "0")
            and os.environ.get(ALLOCATOR, "") == "platform")


def nbytes_of(jax, tree) -> int:
    """Bytes of a pytree's arrays (real ones, or ``jax.eval_shape``'s ShapeDtypeStructs)."""
    import numpy as np
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


_HANDLES: dict[int, Any] = {}


def _ordinal(device) -> int:
    hw = getattr(device, "local_hardware_id", None)
    return int(hw if hw is not None else device.id)


def nvml_handle(device):
    """NVML's handle of a JAX GPU device (its CUDA ordinal read through CUDA_VISIBLE_DEVICES); None without NVML."""
    if device.platform not in ("gpu", "cuda"):
        return None
    n = _ordinal(device)
    if n not in _HANDLES:
        _HANDLES[n] = None
        try:
            import pynvml
            pynvml.nvmlInit()
            seen = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            name = seen[n] if seen else str(n)
            _HANDLES[n] = (pynvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit()
                           else pynvml.nvmlDeviceGetHandleByUUID(name))
        except Exception:                          # no NVML here: XLA's own counts stand in
            _HANDLES[n] = None
    return _HANDLES[n]


def process_device_bytes(device) -> int | None:
    """This process's memory on ``device`` as NVML shows it; None where it cannot (no GPU, no NVML,
    another pid namespace)."""
    handle = nvml_handle(device)
    if handle is None:
        return None
    try:
        import pynvml
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except Exception:                              # best effort
        return None
    return None


class JaxMemory:
    """Tagged pytrees on one JAX device, with a retained host backup (``SwapMemory``'s shape)."""

    pins_unheld = True        # prepin is host work from declared sizes: cooperate may come before the first hold
    # The driver checkpoint must never take this process (cooperate() registers it so: lockd then never
    # moves its residue by checkpoint, the agent never checkpoints it): on the H200 a JAX process died
    # of SIGSEGV 0.7-4 s after every cuda-checkpoint of it (benchmarks/results/gpu_round4.md).
    checkpoint_safe = False

    def __init__(self, tags: Mapping[str, str] | None = None, *, device=None, backup: str = "auto",
                 checksum: bool = True, host_bytes: Mapping[str, int] | None = None, pin_method: str = "auto",
                 pin_threads: int | None = None, allocator: str | None = "platform"):
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
        self.tags = dict(DEFAULT_TAGS if tags is None else tags)
        for tag, policy in self.tags.items():
            if policy not in POLICIES:
                raise ValueError(f"tag {tag!r}: policy must be one of {POLICIES}, got {policy!r}")
        unknown = sorted(set(host_bytes or {}) - {t for t, p in self.tags.items() if p == OFFLOAD})
        if unknown:
            raise ValueError(f"host_bytes names tags that are not offload regions: {unknown}")
        returning = returning_allocator() if allocator == "platform" else None
        import jax
        self.jax = jax
        self.device = device if device is not None else jax.devices()[0]
        self.gpu = self.device.platform in ("gpu", "cuda")
        if self.gpu and returning is False:
            log.warning("jax_allocator_keeps_freed_memory", hint=f"JAX's GPU backend started before {PREALLOCATE}=false "
                        f"and {ALLOCATOR}=platform were set: a pause frees nothing XLA's pool keeps; make the "
                        "JaxMemory before any JAX array, or set both in the job's environment")
        self._regions = {t: TreeRegion(i) for i, t in enumerate(self.tags)}
        self._trees: dict[str, Any] = {}
        self._paused: set[str] = set()
        self._declared = {t: int(n) for t, n in (host_bytes or {}).items()}
        self._mu = threading.RLock()                # the job's puts and reads against the channel's pause
        self._listener: Callable[[], None] | None = None
        self._peak_seen = 0
        self._hold_peak = 0
        self._nvml_peak = 0
        self._sampler: threading.Thread | None = None
        self._closed_ev = threading.Event()
        # The sampler reads only inside a hold (from reset_peak to the yield's figures or a pause), each read
        # under this lock, so none is in flight once a hold has ended: NVML's process query made while
        # the agent had the process checkpointed (cuda-checkpoint) crashed it with SIGSEGV on the H200.
        self._sample_mu = threading.Lock()
        self._sampling = False
        self.left_behind: dict | None = None         # what the first pause found outside the regions
        self.pauses = 0
        self.backup = self._choose(backup)
        pool, mover = self._backup_parts(pin_method, pin_threads)
        self.host_pool = pool
        self.book = BackupBook(pool, mover, checksum=checksum)

    # -- the backup's parts (the simulator's subclass has its own) ---------------------------
    def _choose(self, backup: str) -> str:
        if backup == "auto":
            return "pool" if self.gpu and self._torch_cuda() else "host"
        if backup == "pool" and not (self.gpu and self._torch_cuda()):
            raise BackupError("backup='pool' needs a CUDA device and PyTorch with CUDA in this process")
        return backup

    @staticmethod
    def _torch_cuda() -> bool:
        try:
            import torch
            return bool(torch.cuda.is_available())
        except Exception:                           # no torch, or one without CUDA: the host path then
            return False

    def ordinal(self) -> int:
        return _ordinal(self.device)

    def _backup_parts(self, pin_method: str, pin_threads: int | None):
        if self.backup == "pool":
            import torch

            from timeslice.jax_regions import JaxTorchMover
            from timeslice.pinned import PinnedPool
            pinned = PinnedPool(pin_method, pin_threads, on_change=self._host_changed)
            return pinned, JaxTorchMover(self.jax, torch, self._regions, self.ordinal(), pinned)
        from timeslice.jax_regions import HeapPool, JaxHostMover
        heap = HeapPool(on_change=self._host_changed)
        return heap, JaxHostMover(self.jax, self._regions, heap)

    def _device_work(self):
        """Around a copy of device memory (the simulator's blocks while the agent froze the process)."""
        return contextlib.nullcontext()

    def _account(self) -> None:
        """The process's holding on the device changed (the simulator books it on its ledger)."""

    # -- the job's side --------------------------------------------------------------------
    def __getitem__(self, tag: str):
        with self._mu:
            self._known(tag)
            if tag in self._paused:
                raise RegionReleased(f"region {tag!r} is paused: its arrays are on the host (device work outside "
                                     "a hold, or before the resume that comes with the next grant)", pid=os.getpid())
            if tag not in self._trees:
                raise KeyError(f"region {tag!r} holds no tree yet")
            return self._trees[tag]

    def get(self, tag: str, default=None):
        try:
            return self[tag]
        except KeyError:
            return default

    def __contains__(self, tag: object) -> bool:
        return tag in self._trees

    def __setitem__(self, tag: str, tree) -> None:
        self.put(tag, tree)

    def put(self, tag: str, tree) -> None:
        """Region ``tag`` holds ``tree`` from now on (its device arrays; other leaves are kept as they are)."""
        jax = self.jax
        with self._mu:
            self._known(tag)
            if tag in self._paused:
                raise RegionReleased(f"region {tag!r} is paused: put its new tree inside a hold", pid=os.getpid())
            flat, treedef = jax.tree_util.tree_flatten(tree)
            r = self._regions[tag]
            if r.treedef is not None and treedef == r.treedef and len(flat) == len(r.items) and all(
                    (x is i.array) if isinstance(i, Leaf) else (x is i) for x, i in zip(flat, r.items)):
                self._trees[tag] = tree                # the same arrays: still what the backup copied
                return
            theirs = {id(leaf.array) for t, o in self._regions.items() if t != tag for leaf in o.leaves}
            made: dict[int, Leaf] = {}
            items: list[Any] = []
            for x in flat:
                if not isinstance(x, jax.Array):
                    items.append(x)
                    continue
                if id(x) in theirs:
                    raise ValueError(f"region {tag!r}: an array of another region is in this tree (one buffer, one region)")
                if id(x) not in made:
                    made[id(x)] = self._leaf(tag, x)
                items.append(made[id(x)])
            before = r.nbytes()
            r.treedef, r.items, r.leaves = treedef, items, list(made.values())
            r.lay_out()
            self._trees[tag] = tree
            if self.tags[tag] == OFFLOAD:
                self.book.mark_clean(tag)              # a new promise: immutable arrays keep it until the next put
            grew = r.nbytes() != before
        self._account()
        self._hold_peak = max(self._hold_peak, self.allocator_bytes())
        if grew:
            self._host_changed()                       # the agent learns the region's size now

    def _leaf(self, tag: str, x) -> Leaf:
        if x.is_deleted():
            raise ValueError(f"region {tag!r}: an array of this tree was deleted (donated?)")
        if x.devices() != {self.device}:
            raise ValueError(f"region {tag!r}: an array lives on {sorted(map(str, x.devices()))}, not on "
                             f"{self.device} (one device per memory; sharded arrays are not supported)")
        return Leaf(tuple(x.shape), x.dtype, x.sharding, int(x.nbytes), x)

    def declare(self, tag: str, what) -> None:
        """Offload region ``tag`` will hold ``what`` (bytes, or a pytree such as ``jax.eval_shape``'s): ``prepin``
        reserves at least that much host backup for it, before the arrays exist."""
        if self.tags.get(tag) != OFFLOAD:
            raise ValueError(f"{tag!r} is not an offload region; declared: {self.tags}")
        n = int(what) if isinstance(what, int) else nbytes_of(self.jax, what)
        self._declared[tag] = max(self._declared.get(tag, 0), n)
        self._host_changed()

    def is_paused(self, tag: str) -> bool:
        return tag in self._paused

    def _known(self, tag: str) -> None:
        if tag not in self.tags:
            raise ValueError(f"unknown tag {tag!r}; declared: {sorted(self.tags)}")

    # -- what the channel asks (SwapMemory) ---------------------------------------------------
    def device_id(self) -> str:
        if not self.gpu:
            return ""
        handle = nvml_handle(self.device)
        if handle is not None:
            import pynvml
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        return f"cuda:{self.ordinal()}"

    def region_bytes(self) -> dict[str, int]:
        return {t: r.nbytes() for t, r in self._regions.items()}

    def host_bytes(self) -> int:
        return self.host_pool.size()

    def host_pending_bytes(self) -> int:
        return self.host_pool.pending_bytes()

    def backup_stats(self) -> dict[str, int]:
        return dict(self.book.stats)

    def set_state_listener(self, fn: Callable[[], None] | None) -> None:
        self._listener = fn

    def _host_changed(self) -> None:
        if self._listener is not None:
            self._listener()

    def prepin(self, tags: Sequence[str] | None = None, background: bool = False) -> None:
        """Reserve the retained host backup of the offload regions ``tags`` (default all): max(declared, live).

        ``background`` (the cooperative worker asks for it before the first hold) is taken as a plain
        pin: a JAX job registers before its first hold (``TimeSlice.register``), so the pin is outside
        any hold all the same, and its job reports how long it took."""
        offload = [t for t, p in self.tags.items() if p == OFFLOAD and (tags is None or t in tags)]
        self.book.reserve({t: max(self._declared.get(t, 0), self._regions[t].nbytes()) for t in offload})

    def pause(self, tags: Sequence[str]) -> int:
        """Copy ``tags`` out (offload, unless unchanged since the last copy) and delete their arrays."""
        moved = 0
        self._stop_sampling()
        with self._mu:
            self._peak_seen = max(self._peak_seen, self.process_bytes() or 0)
            self._hold_peak = max(self._hold_peak, self.allocator_bytes())     # the hold's end: all still there
            for t in tags:
                self._known(t)
                if t in self._paused:
                    continue
                with self._device_work():
                    moved += self._pause_one(t)
            self.pauses += 1
            if self.backup == "pool":
                # The checksums' temporaries came from torch's caching allocator (this runs after the
                # yield's own cache release): give them back too, or they stay as residue.
                import torch
                torch.cuda.empty_cache()
            if self.left_behind is None:
                self._report_left_behind()
        return moved

    def _pause_one(self, tag: str) -> int:
        r = self._regions[tag]
        if r.treedef is None:                      # never put: nothing to move, but reads wait for the resume
            self._paused.add(tag)
            return 0
        arrays = [leaf.array for leaf in r.leaves]
        dead = [i for i, a in enumerate(arrays) if a.is_deleted()]
        if dead:
            raise BackupError(f"region {tag!r}: {len(dead)} of its arrays were deleted outside the memory "
                              "(donated to a jitted call?): put the tree that replaced them")
        self.jax.block_until_ready(arrays)         # nothing queued may still read or write them
        moved = self.book.pause(tag) if self.tags[tag] == OFFLOAD and r.spanned else 0
        for leaf in r.leaves:
            leaf.array.delete()                    # the buffer goes back now, whoever refers to it
            leaf.array = None
        self._trees[tag] = None
        self._paused.add(tag)
        self._account()                            # only now is the device memory given back
        return moved

    def resume(self, tags: Sequence[str]) -> int:
        """Make ``tags``' arrays again: offload regions from the host copy (verified), discard ones zeroed."""
        moved = 0
        with self._mu:
            for t in tags:
                self._known(t)
                if t not in self._paused:
                    continue
                with self._device_work():
                    moved += self._resume_one(t)
        return moved

    def _resume_one(self, tag: str) -> int:
        r = self._regions[tag]
        self._paused.discard(tag)
        if r.treedef is None:
            return 0
        try:
            self._account()                        # room first (the simulator's ledger refuses what does not fit)
            moved = self.book.resume(tag) if self.tags[tag] == OFFLOAD and r.spanned else 0
            jnp = self.jax.numpy
            for leaf in r.leaves:
                if leaf.array is None:             # a discard region, or an empty array
                    leaf.array = jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)
        except BaseException:
            for leaf in r.leaves:
                if leaf.array is not None:
                    leaf.array.delete()
                    leaf.array = None
            self._paused.add(tag)
            self._account()
            raise
        self._trees[tag] = self.jax.tree_util.tree_unflatten(
            r.treedef, [i.array if isinstance(i, Leaf) else i for i in r.items])
        return moved

    # -- what stays behind ------------------------------------------------------------------
    def outside(self) -> dict:
        """The live arrays on this device that are in no resident region: how many, their bytes, the largest."""
        mine = {id(leaf.array) for r in self._regions.values() for leaf in r.leaves if leaf.array is not None}
        others = [a for a in self.jax.live_arrays() if id(a) not in mine and not a.is_deleted()
                  and self.device in a.devices()]
        others.sort(key=lambda a: -int(a.nbytes))
        return {"arrays": len(others), "bytes": sum(int(a.nbytes) for a in others),
                "largest": [{"shape": list(a.shape), "dtype": str(a.dtype), "bytes": int(a.nbytes)}
                            for a in others[:LARGEST]]}

    def _report_left_behind(self) -> None:
        self.left_behind = got = self.outside()
        if got["arrays"]:
            log.warning("jax_arrays_outside_regions", arrays=got["arrays"], bytes=got["bytes"], largest=got["largest"],
                        hint="these stay on the device while the job is parked: put them in a region "
                             "(memory[tag] = tree) or drop them before the hold ends")
        else:
            log.info("jax_arrays_outside_regions", arrays=0, bytes=0)

    def residue_bytes(self) -> int:
        """Device bytes this process keeps outside its resident regions (after a full pause: all it keeps)."""
        resident = sum(r.nbytes() for t, r in self._regions.items() if t not in self._paused)
        used = self.process_bytes()
        if used is not None:
            return max(0, used - resident)
        stats = self._stats()
        if "bytes_in_use" in stats:               # XLA's count: no context, no workspaces
            return max(0, int(stats["bytes_in_use"]) - resident)
        return self.outside()["bytes"]

    def peak_bytes(self) -> int:
        """The most this process has held on the device, as far as it can tell (XLA's peak plus what it cannot see)."""
        stats = self._stats()
        used = self.process_bytes()
        beside = max(0, used - int(stats["bytes_in_use"])) if used is not None and "bytes_in_use" in stats else 0
        return max(self._peak_seen, int(stats.get("peak_bytes_in_use", 0)) + beside, self.planned_bytes(), used or 0)

    def planned_bytes(self) -> int:
        """Every region's bytes, as declared where they are not made yet (what the job will need of them)."""
        return sum(max(self._declared.get(t, 0), r.nbytes()) for t, r in self._regions.items())

    # -- DeviceStats: what the client measures at each yield for the footprint its grants admit ---
    def reset_peak(self) -> None:
        """A hold starts. XLA's own peak cannot be reset (a lifetime figure: larger, never wrong); ours is.
        On a GPU with NVML a sampler also keeps the process's largest holding in the hold: with the
        platform allocator XLA may count nothing, and its temporaries are no live arrays."""
        self._hold_peak = self.allocator_bytes()
        with self._sample_mu:
            self._nvml_peak = 0
            self._sampling = True
        if self.gpu and self._sampler is None and nvml_handle(self.device) is not None:
            self._sampler = threading.Thread(target=self._sample, name="timeslice-jax-peak", daemon=True)
            self._sampler.start()

    def _stop_sampling(self) -> None:
        """The hold has ended (its figures are taken, or a pause came): no NVML read from now until the next."""
        with self._sample_mu:
            self._sampling = False

    def _sample(self) -> None:
        while not self._closed_ev.wait(SAMPLE_S):
            with self._sample_mu:
                if self._sampling:
                    self._nvml_peak = max(self._nvml_peak, self.process_bytes() or 0)

    def allocator_bytes(self) -> int:
        """XLA's count of the bytes it holds now, else the live arrays on this device."""
        stats = self._stats()
        if "bytes_in_use" in stats:
            return int(stats["bytes_in_use"])
        return sum(int(a.nbytes) for a in self.jax.live_arrays() if self.device in a.devices())

    def allocator_peak_bytes(self) -> int:
        self._stop_sampling()                 # the yield takes the hold's figures: the hold is over
        now = self.allocator_bytes()
        self._hold_peak = max(self._hold_peak, now)
        used = self.process_bytes()
        seen = self._nvml_peak - (used - now) if used is not None and self._nvml_peak else 0   # less what is no allocation
        return max(int(self._stats().get("peak_bytes_in_use", 0)), self._hold_peak, seen)

    def device_used_bytes(self) -> int | None:
        return self.process_bytes()

    def set_host_admission(self, admit: Callable[[int], None] | None) -> None:
        """The node agent's host admission (the cooperative worker sets it): asked before the pool grows."""
        self.host_pool.admit = admit

    def _stats(self) -> dict:
        try:
            return dict(self.device.memory_stats() or {})
        except Exception:                          # a backend without statistics
            return {}

    def process_bytes(self) -> int | None:
        """This process's device memory as NVML shows it; None where it cannot (no GPU, no NVML, another pid namespace)."""
        return process_device_bytes(self.device)

    def close(self) -> None:
        """The job is done with the device (inside its last hold): every region's arrays are deleted."""
        self._closed_ev.set()
        with self._mu:
            for r in self._regions.values():
                for leaf in r.leaves:
                    if leaf.array is not None and not leaf.array.is_deleted():
                        leaf.array.delete()
                    leaf.array = None
            self._trees.clear()
        self._account()

