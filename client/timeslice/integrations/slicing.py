"""One job's time-slicing on one group, as a framework integration drives it.

    ts = TimeSlice(client, "rl-gpus")          # cooperative, torch-memory-saver regions (default)
    with ts.hold():                            # acquire (nested holds do not acquire again)
        model = ts.regions.module(build_model(), "cuda")
        ts.register()                          # cooperate(memory): channel, registration, pinned backup
        ...
        with ts.released():                    # CPU work (rewards): the group is free for others
            ...

``swap`` says how the node agent moves this job's memory while it is parked: a kind
the job library registers its own process with (``common/swaps.py``, ``in_job``):
``"cooperative"`` (the process pauses its own regions; default), ``"checkpoint"``
(the agent checkpoints the whole process; nothing is placed in regions); or
``"none"`` (holds only, no worker registered: for jobs that fit side by side). With ``client=None``
nothing is acquired (a standalone run of the same code), but the same cache
release happens at every point where a sliced run would yield, so both runs
allocate alike.

Every hold and every phase span is written to ``log`` (a ``PhaseLog``), with
monotonic times, the grant's figures and, for GPU phases, what they processed:
what a benchmark needs to compute duty cycle and per-phase throughput.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from timeslice.common import defaults as D
from timeslice.common import swaps
from timeslice.config import node_name
from timeslice.hooks import cap_allocator, release_framework_cache
from timeslice.integrations.pytorch import ModelRegions
from timeslice.logs import get_logger

log = get_logger(__name__)
NO_SWAP = "none"                          # holds only: no worker is registered
SWAPS = (*swaps.job_kinds(), NO_SWAP)


def _cuda_ready() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class PhaseLog:
    """Holds and phase spans of one job, as dicts (``events``); ``sync`` makes the end of a
    ``gpu=True`` span wait for the device work it queued (``torch.cuda.synchronize``), for
    honest timings."""

    def __init__(self, sync: bool = False):
        self.events: list[dict] = []
        self.sync = sync

    @contextlib.contextmanager
    def span(self, name: str, **fields: Any) -> Iterator[dict]:
        ev = {"ev": "span", "name": name, "start": time.monotonic(), **fields}
        try:
            yield ev                              # the body may add figures (tokens, samples)
        finally:
            # Only a GPU span waits for its device work: a CPU span runs outside the hold, where
            # the process must not touch its device (it may be checkpointed: the call would block).
            if self.sync and fields.get("gpu") and _cuda_ready():
                sys.modules["torch"].cuda.synchronize()
            ev["end"] = time.monotonic()
            self.events.append(ev)

    def add(self, ev: str, **fields: Any) -> None:
        self.events.append({"ev": ev, "t": time.monotonic(), **fields})


class TimeSlice:
    """Holds on ``group_id`` for one job (client may be None: standalone), with its memory."""

    def __init__(self, client, group_id: str = "", memory=None, *, swap: str = swaps.COOPERATIVE,
                 device_bytes_hint: int = 0, timeout: float | None = None, node: str | None = None,
                 socket_path: str | None = None, gpus=(), sync_phases: bool = False, exclusive: bool = False):
        """``exclusive``: every hold asks for the group's GPUs alone (a fit group: nobody beside it);
        ``hold(exclusive=True)`` asks it for one phase."""
        if swap not in SWAPS:
            raise ValueError(f"swap must be one of {SWAPS}, got {swap!r}")
        if client is not None and not group_id:
            raise ValueError("a group_id is needed to time-slice")
        self.client, self.group_id, self.swap = client, group_id, swap
        self.timeout, self.node, self.socket_path, self.gpus = timeout, node, socket_path, tuple(gpus)
        self.hint = int(device_bytes_hint)
        self.exclusive = bool(exclusive)
        self._held_exclusive = self.exclusive
        self.transient_bytes = 0       # expected beside the regions at the peak (e.g. gradients)
        self._memory = memory
        self._regions: ModelRegions | None = None
        self.worker = None
        self.log = PhaseLog(sync_phases)
        self._depth = 0
        self._scope: Any = None
        self._open: dict | None = None
        self._next_hint: int | None = None
        self._registered = False

    # -- memory ------------------------------------------------------------------------
    @property
    def memory(self):
        """The cooperative memory; torch-memory-saver regions on the current CUDA device unless
        one was given. Made on first use, which should be inside a hold (it initialises CUDA)."""
        if self._memory is None and self.swap == swaps.COOPERATIVE:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("swap='cooperative' needs a memory to pause: no CUDA device here; give one "
                                   "(on the simulated device, SimTorchMemory) or use swap='none'")
            from timeslice.torch_memory import TorchMemory
            # graphs: where a dense generator (timeslice.integrations.dense) keeps its static KV
            # cache and CUDA graphs; released at a swap without a copy, empty unless one is used.
            self._memory = TorchMemory({"weights": "offload", "optimizer": "offload", "graphs": "discard"})
        return self._memory

    @property
    def regions(self) -> ModelRegions | _NoRegions:
        """Where modules and optimizers go: the memory's regions, or nowhere (checkpoint, none)."""
        if self.memory is None:
            return _NoRegions()
        if self._regions is None:
            self._regions = ModelRegions(self.memory, worker=self.worker, on_grow=self._grew)
        return self._regions

    def _grew(self, tag: str, seconds: float) -> None:
        self.log.add("region", tag=tag, bytes=self.memory.region_bytes().get(tag, 0), pin_s=seconds)

    # -- holds -------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, exclusive: bool | None = None) -> Iterator[Any]:
        """Hold the group for the body (re-entrant); yields the grant (None standalone).
        ``exclusive``: this hold wants the GPUs alone (None: the TimeSlice's setting); the
        outermost hold's choice counts."""
        if self._depth == 0:
            self._enter(self.exclusive if exclusive is None else exclusive)
        self._depth += 1
        try:
            yield None if self._open is None else self._open.get("grant")
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._exit()

    @contextlib.contextmanager
    def released(self, why: str = "cpu") -> Iterator[None]:
        """Let go of the group for the body (CPU work), then take it back at the same depth.

        Inside, the device must not be touched at all: the job's regions may be
        released, or the whole process checkpointed (a CUDA call would then block
        until the next grant, which the job would never ask for)."""
        depth, self._depth = self._depth, 0
        if depth:
            try:
                self._exit()
            except BaseException:
                self._depth = depth          # the hold's own exit sees it (and finds nothing left to yield)
                raise
        try:
            with self.log.span(why, gpu=False):
                yield
        finally:
            try:
                if depth:
                    self._enter(self._held_exclusive)
            finally:
                self._depth = depth

    @property
    def held(self) -> bool:
        return self._depth > 0

    def expect_first(self, nbytes: int) -> None:
        """Before the first hold: the device bytes it will take (a model about to be moved there), so
        that lockd plans its first grant on that instead of an unknown footprint (for which it makes
        room: an emptied device). The user's ``device_bytes_hint`` still counts if it is larger."""
        if self._next_hint is None and self._depth == 0:
            self._next_hint = max(self.hint, int(nbytes))

    def _hint(self) -> int:
        """The device bytes to ask room for: the user's hint, the peak measured so far, or what the
        regions hold plus what they are still expected to grow by (the optimizer state AdamW makes
        at its first step: planned for before it exists, or the step would not fit)."""
        mem = self._memory
        if mem is None or not self._registered:
            return self.hint
        peak_of = getattr(mem, "peak_bytes", None)
        peak = peak_of() if peak_of is not None else sum(mem.region_bytes().values())
        missing = self._regions.missing_bytes() if self._regions is not None else 0
        if missing:
            peak += missing + self.transient_bytes
        return max(self.hint, peak)

    def _enter(self, exclusive: bool | None = None) -> None:
        t_req = time.monotonic()
        exclusive = self.exclusive if exclusive is None else exclusive
        self._held_exclusive = exclusive          # released() takes the group back the same way
        grant = None
        if self.client is not None:
            # The hint was worked out at the last release, while holding: outside a hold this
            # process must not ask anything of its device (it may be checkpointed).
            # Before the first hold the process has never been parked: a memory registered then (its sizes
            # declared, ``pins_unheld``) can say what its first hold needs.
            hint = (self._next_hint if self._next_hint is not None else
                    self._hint() if self._registered else self.hint)
            scope = self.client.on_accelerators(self.group_id, timeout=self.timeout, device_bytes_hint=hint,
                                                exclusive=exclusive)
            grant = scope.__enter__()
            self._scope = scope
            if grant is not None and _cuda_ready() and os.environ.get(D.ENV_ALLOCATOR_CAP, "1") != "0":
                # A fit group's holders share the GPU: this job's allocator stays within what it was admitted.
                cap_allocator(grant.footprint_bytes, grant.exclusive, self.node or node_name())
        self._open = {"t_req": t_req, "t_grant": time.monotonic(), "grant": grant}

    def _exit(self) -> None:
        held, self._open = self._open, None
        if held is not None:
            self._next_hint = self._hint()
        t_end = time.monotonic()
        if self.client is not None and self._scope is not None:
            if not self.client.release_cache and _cuda_ready():
                sys.modules["torch"].cuda.synchronize()   # the next job may run as soon as we yield
            scope, self._scope = self._scope, None
            scope.__exit__(None, None, None)
        elif _cuda_ready():
            release_framework_cache()                 # standalone: allocate as a sliced run does
        if held is not None:
            g = held["grant"]
            self.log.add("hold", t_req=held["t_req"], t_grant=held["t_grant"], t_release=t_end,
                         token=getattr(g, "token", 0), restored=getattr(g, "restored", False),
                         elided=getattr(g, "elided", False), bytes_moved=getattr(g, "bytes_moved", 0),
                         waited_ms=getattr(g, "waited_ms", 0.0), footprint=dict(getattr(g, "footprint_bytes", {})),
                         exclusive=getattr(g, "exclusive", False), backfilled=getattr(g, "backfilled", False))

    # -- registration ---------------------------------------------------------------------
    def register(self) -> None:
        """Tell the node agent about this process (once).

        Cooperative: best *before* the first hold, with the regions' sizes expected
        (``regions.expect``): the host backup is then pinned on a thread of its own while the job
        builds its model and waits for its first grant (``cooperate(prepin="background")``; its
        first pause waits for it). Inside a hold the pin runs at once, inside the hold. Checkpoint:
        inside a hold, once the memory is on the device (the agent is told how much). A memory whose
        sizes are declared before its arrays exist (``timeslice.integrations.jax.JaxMemory``) registers
        before the first hold the same way."""
        if self._registered:
            return
        if self.client is None or self.swap == NO_SWAP:
            self._registered = True
            return
        if not self.held and self.swap != swaps.COOPERATIVE:
            raise RuntimeError("TimeSlice.register() runs inside a hold: the model must be on the device")
        self._registered = True
        t0 = time.monotonic()
        if self.swap == swaps.COOPERATIVE:
            self.worker = self.client.cooperate(self.memory, node=self.node, socket_path=self.socket_path,
                                                gpus=self.gpus, prepin=True if self.held else "background")
            if self._regions is not None:
                self._regions.worker = self.worker
        else:
            used = 0
            if _cuda_ready():
                used = sys.modules["torch"].cuda.memory_reserved()
            self.client.register_worker(node=self.node, device_bytes=used, gpus=self.gpus)
        self.log.add("registered", swap=self.swap, seconds=time.monotonic() - t0, held=self.held,
                     region_bytes=self.memory.region_bytes() if self.memory is not None else {},
                     host_bytes=self.memory.host_bytes() if self.memory is not None else 0)
        log.info("timeslice_registered", group=self.group_id, swap=self.swap,
                 seconds=round(time.monotonic() - t0, 3))


    def finish(self) -> None:
        """The job is done with the device: inside its last hold, give the memory back (its
        ``close()``: torch-memory-saver's regions released as it accepts, the simulator's
        device memory returned) and withdraw the worker, so no later swap plans for a process
        on its way out (its channel closes with the client). Without it the job still exits
        with its own status: at exit its regions are detached (``timeslice.torch_release``)."""
        if not self.held:
            raise RuntimeError("TimeSlice.finish() runs inside a hold")
        close = getattr(self._memory, "close", None)
        if close is not None:
            close()
        if self.client is not None and self._registered and self.swap != NO_SWAP:
            pid = self.worker.pid if self.worker is not None else None
            self.client.unregister_worker(pid=pid, node=self.node)
        self.log.add("finished")


class _NoRegions:
    """checkpoint / none: nothing is put in regions; modules just move to the device."""

    worker = None

    def module(self, module, device=None):
        return module if device is None else module.to(device)

    def optimizer(self, optimizer):
        return optimizer

    def adopt(self, tag: str, tensors) -> None:
        pass

    def expect(self, tag: str, nbytes: int) -> None:
        pass

    def missing_bytes(self) -> int:
        return 0
