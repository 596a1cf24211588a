"""One backend for the agent, whatever each worker's swap kind: checkpoint, cooperative or app endpoint.

The agent's machinery (admission, the per-process parallel ops, the job
picture, the direct API) speaks the checkpoint state machine of
``base.Backend``. ``CompositeBackend`` keeps that one interface and sends each
pid where its registration says (``WorkerValue.swap``):

* no swapper (``checkpoint``): the node's checkpoint backend, unchanged;
* a swapper (``cooperative``, ``vllm``, ``sglang``): the worker moves its own
  memory. Its states map onto the machine: paused -> CHECKPOINTED (PARTIAL
  while a selective pause left some of its regions on the device), running ->
  RUNNING; ``lock`` is a no-op (the worker needs its context to copy);
  ``checkpoint`` asks it to pause (a PARTIAL one: what is still resident),
  ``restore`` to resume.

Around a cooperative pause the checkpoint backend still has a role:

* ``isolation="full"`` or ``"strict"`` (group policy): after the pause the CUDA
  checkpoint takes what is left (context, stray allocations); restore runs it
  backwards. A worker frozen in place (a strict group's elided handoff) is
  unlocked before its pause: the pause is CUDA work of its own;
* ``freeze`` (off by default; agent flag ``--freeze-parked``): after the pause
  the process is locked (the driver's lock, ~0.5 ms), so a stray device call
  outside a hold *waits* instead of touching a released page. Measured on an
  H200 (benchmarks/gpu_swap_probe.py): the stray call did wait while parked,
  but the lock must be lifted before the worker can resume (resuming is CUDA
  work too), and the waiting call then ran first and faulted (illegal address,
  the process lost). So the freeze only moves the fault from the stray call to
  the next grant, where it is harder to diagnose: the rule stays "touch the
  device only while holding", and the freeze is an opt-in for debugging.

``prepare`` tells the backend, per op, the group's isolation and how many
device bytes the incoming job needs; when that is less than everything the
cooperative workers release only some regions: ``discard`` regions first (no
copy at all), then ``offload`` regions, largest first.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from timeslice.common import device_errors as e
from timeslice.common import swaps
from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import Backend, DeviceBytes, ProcState
from timeslice.nodeagent.backends.swapper import Swapper, SwapState

log = structlog.get_logger(__name__)

DEFAULT_SWAP_DEADLINE_S = 120.0      # a 140 GB region at PCIe speed takes ~3 s; a first pinning ~60 s
FREEZE_LOCK_TIMEOUT_MS = 2_000       # after a pause nothing of the job's should be in flight


@dataclass
class OpContext:
    isolation: str = R.ISOLATION_NONE
    need_bytes: int = 0                                      # 0: release everything
    tags: dict[int, list[str] | None] = field(default_factory=dict)   # pid -> tags to pause (None: all)


def choose_tags(regions: dict[int, tuple[dict[str, str], dict[str, int]]], need_bytes: int
                ) -> dict[int, list[str] | None]:
    """Which regions to release so that at least ``need_bytes`` are freed; sans-IO.

    ``regions``: pid -> (tag -> policy, tag -> bytes) of the resident regions.
    Discard regions go first (releasing them copies nothing), then offload
    regions, largest first. ``need_bytes <= 0`` or not enough in total: all.
    """
    if need_bytes <= 0:
        return {p: None for p in regions}
    order = sorted(((pol != R.TAG_DISCARD, -nbytes, pid, tag)
                    for pid, (tags, sizes) in regions.items()
                    for tag, pol in tags.items() for nbytes in [sizes.get(tag, 0)] if nbytes > 0))
    if sum(-o[1] for o in order) <= need_bytes:
        return {p: None for p in regions}
    out: dict[int, list[str] | None] = {p: [] for p in regions}
    freed = 0
    for _, neg, pid, tag in order:
        if freed >= need_bytes:
            break
        out[pid].append(tag)  # type: ignore[union-attr]
        freed += -neg
    return out


class CompositeBackend(Backend):
    def __init__(self, base: Backend, resolve: Callable[[int], Swapper | None],
                 deadline_s: float = DEFAULT_SWAP_DEADLINE_S, freeze: bool = False,
                 lock_timeout_ms: int = 10_000):
        self.base, self.resolve, self.deadline_s, self.freeze = base, resolve, deadline_s, freeze
        self.lock_timeout_ms = lock_timeout_ms
        self.name, self.why = base.name, base.why
        self.restore_headroom_bytes = base.restore_headroom_bytes
        self._ctx: dict[int, OpContext] = {}
        self._mu = threading.Lock()

    def describe(self) -> dict:
        return {**self.base.describe(), "swappers": swaps.swapper_kinds(), "freeze": self.freeze}

    # -- per-op context ------------------------------------------------------------
    def prepare(self, op: str, pids: Sequence[int], isolation: str = "", need_bytes: int = 0) -> None:
        """Called by the runner before an op on ``pids``: the group's isolation and the room needed."""
        ctx = OpContext(isolation, need_bytes)
        if op == R.SNAPSHOT:
            regions = {}
            for p in pids:
                sw = self.resolve(p)
                if sw is not None and sw.state() in (SwapState.RUNNING, SwapState.PAUSED):
                    left = sw.resident_regions()     # paused in part: only what is still there can go
                    if left:
                        regions[p] = ({t: pol for t, pol in sw.tags().items() if t in left}, left)
            ctx.tags = choose_tags(regions, 0 if R.checkpoints_rest(isolation) else need_bytes)
        with self._mu:
            for p in pids:
                self._ctx[p] = ctx

    def finish(self, pids: Sequence[int]) -> None:
        with self._mu:
            for p in pids:
                self._ctx.pop(p, None)

    def _context(self, pid: int) -> OpContext:
        with self._mu:
            return self._ctx.get(pid) or OpContext()

    # -- the state machine ---------------------------------------------------------
    def get_state(self, pid: int) -> ProcState:
        sw = self.resolve(pid)
        b = self.base.get_state(pid)
        if sw is None or b is ProcState.GONE:
            return b
        s = sw.state()
        if s is SwapState.GONE:
            return ProcState.GONE
        if b in (ProcState.CHECKPOINTED, ProcState.FAILED):
            return b                                    # full isolation's checkpoint (or its loss)
        if s is SwapState.PAUSED:
            if sw.releasable_bytes() > 0:
                return ProcState.PARTIAL
            if R.checkpoints_rest(self._context(pid).isolation) and b in (ProcState.RUNNING, ProcState.LOCKED):
                return ProcState.PARTIAL                # an op of full isolation: the rest is still to go
            return ProcState.CHECKPOINTED
        if s is SwapState.RUNNING:
            return ProcState.LOCKED if b is ProcState.LOCKED else ProcState.RUNNING
        return ProcState.UNKNOWN                         # registered, but it never spoke to this agent

    def lock(self, pid: int, timeout_ms: int) -> None:
        if self.resolve(pid) is None:
            self.base.lock(pid, timeout_ms)
        # A cooperative worker needs its context to copy: nothing to lock before the pause.

    def checkpoint(self, pid: int) -> int:
        sw = self.resolve(pid)
        if sw is None:
            return self.base.checkpoint(pid)
        ctx = self._context(pid)
        if self.base.get_state(pid) is ProcState.LOCKED:
            self.base.unlock(pid)                        # frozen in place: the worker needs its context to copy
        rep = sw.pause(ctx.tags.get(pid), self.deadline_s)
        moved = rep.bytes_moved
        b = self.base.get_state(pid)
        if R.checkpoints_rest(ctx.isolation) and b in (ProcState.RUNNING, ProcState.LOCKED):
            try:
                if b is ProcState.RUNNING:
                    self.base.lock(pid, self.lock_timeout_ms)
                moved += self.base.checkpoint(pid)
            except Exception:
                self._undo(pid, sw)
                raise
        elif self.freeze and b is ProcState.RUNNING:
            try:
                self.base.lock(pid, FREEZE_LOCK_TIMEOUT_MS)
            except e.BackendError as exc:     # still paused, only not frozen: say so, do not fail the swap
                log.warning("freeze_failed", pid=pid, error=str(exc))
        log.info("cooperative_paused", pid=pid, kind=sw.kind, tags=rep.tags, bytes_moved=rep.bytes_moved,
                 device_bytes=rep.device_bytes, elapsed_ms=round(rep.elapsed_ms, 2), isolation=ctx.isolation,
                 residue_bytes=rep.detail.get("residue_bytes"))
        return moved

    def _undo(self, pid: int, sw: Swapper) -> None:
        """A full-isolation checkpoint failed after the pause: give the process its memory back."""
        try:
            if self.base.get_state(pid) is ProcState.LOCKED:
                self.base.unlock(pid)
            sw.resume(self.deadline_s)
        except Exception as exc:  # the original failure is what gets reported
            log.error("cooperative_undo_failed", pid=pid, error=str(exc))

    def restore(self, pid: int) -> int:
        sw = self.resolve(pid)
        if sw is None:
            return self.base.restore(pid)
        moved = 0
        b = self.base.get_state(pid)
        if b is ProcState.CHECKPOINTED:
            moved += self.base.restore(pid)
            b = ProcState.LOCKED
        if b is ProcState.LOCKED:
            self.base.unlock(pid)                        # the worker needs its context to copy back
        rep = sw.resume(self.deadline_s)
        log.info("cooperative_resumed", pid=pid, kind=sw.kind, tags=rep.tags, bytes_moved=rep.bytes_moved,
                 device_bytes=rep.device_bytes, elapsed_ms=round(rep.elapsed_ms, 2))
        return moved + rep.bytes_moved

    def unlock(self, pid: int) -> None:
        sw = self.resolve(pid)
        if sw is None:
            self.base.unlock(pid)
            return
        if self.base.get_state(pid) is ProcState.LOCKED:
            self.base.unlock(pid)
        if sw.state() is SwapState.PAUSED:
            sw.resume(self.deadline_s)

    # -- sizes ---------------------------------------------------------------------
    def device_usage(self, pid: int) -> DeviceBytes | None:
        return self.base.device_usage(pid)

    def device_free(self) -> DeviceBytes | None:
        return self.base.device_free()

    def snapshot_usage(self, pid: int) -> DeviceBytes | None:
        sw = self.resolve(pid)
        if sw is None:
            return self.base.snapshot_usage(pid)
        out = dict(self.base.snapshot_usage(pid) or {})
        paused = sw.paused_bytes()
        if paused is None:
            return out or None
        dev = sw.device()
        if not dev:
            free = self.base.device_free() or {}
            dev = next(iter(free)) if len(free) == 1 else ""
        if not dev:
            return None                                  # cannot say where: admission refuses, nothing is lost
        out[dev] = out.get(dev, 0) + paused
        return out

    def residue_bytes(self, pid: int) -> int | None:
        """Device bytes a paused cooperative ``pid`` keeps outside its regions (its own measure);
        0 once full isolation checkpointed the rest; None where nobody can say."""
        sw = self.resolve(pid)
        kind = swaps.kind_of(sw.kind) if sw is not None else None
        if sw is None or kind is None or not kind.regions:
            return None                                  # a swapper without regions measures no residue
        if self.base.get_state(pid) is ProcState.CHECKPOINTED:
            return 0                                     # the driver checkpoint took what the pause left
        return sw.residue_bytes()

    def host_bytes_needed(self, pid: int) -> int | None:
        """Host memory a snapshot of ``pid`` will take that is not allocated yet."""
        sw = self.resolve(pid)
        if sw is None:
            return self.base.device_bytes(pid)
        ctx = self._context(pid)
        tags, sizes = sw.tags(), sw.region_bytes()
        chosen = ctx.tags.get(pid)
        chosen = list(tags) if chosen is None else chosen
        offload = sum(sizes.get(t, 0) for t in chosen if tags.get(t) == R.TAG_OFFLOAD)
        need = max(0, offload - sw.host_bytes())
        if R.checkpoints_rest(ctx.isolation):
            rest = (self.base.device_bytes(pid) or 0) - sum(sizes.values())
            need += max(0, rest)
        return need

    def reap(self) -> list[int]:
        return self.base.reap()

    def close(self) -> None:
        self.base.close()

    def __getattr__(self, name):
        # Anything else the agent asks of its backend (meters, simulator paths) is the base's.
        return getattr(self.base, name)
