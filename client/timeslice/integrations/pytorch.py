"""Put a PyTorch model and its optimizer into a cooperative memory's tagged regions.

    memory = TorchMemory()                        # tags: weights, optimizer (offload), kv_cache (discard)
    place = ModelRegions(memory)

    @client.on_accelerators(group_id="rl-gpus")
    def generate_phase(prompts):
        if model is None:                         # the first hold: load, then cooperate
            model = place.module(build_model(), "cuda")
            optimizer = place.optimizer(torch.optim.AdamW(model.parameters()))
            place.worker = client.cooperate(memory)
        ...

torch-memory-saver's rule is that a tensor belongs to a region only if it was
*allocated* inside ``region(tag)``; a tensor made anywhere else is residue the
cooperative pause cannot release. Two places break that rule in an ordinary
loop, and this helper covers both:

* the weights: ``module(m, device)`` moves the module to the device inside the
  weights region (a module already on the device was allocated outside it:
  build it on the CPU, or inside ``memory.region("weights")`` yourself);
* the optimizer state, which AdamW and its kin create lazily at the first
  ``step()`` (and ``load_state_dict()`` when resuming): ``optimizer(opt)`` runs
  every step that will create state, and every load, inside the optimizer
  region. Gradients are not placed: ``zero_grad()`` (``set_to_none``, the
  default) frees them every step, and the yield's cache release gives their
  blocks back.

When a region grows (the first step), the retained host backup of the new state
is pinned at once, inside the hold (``memory.prepin``), and the node agent is
told the new sizes (``worker.announce(sync=True)``), so its first swap costs no pinning
and the hold ends only once the agent's report counts them: a grant planned after
it never takes the new state for free device memory.

On the CPU stand-in (``timeslice.sim.torch_memory.SimTorchMemory``, a
SIMULATOR) the same calls *adopt* the tensors instead, which lets CI check that
nothing runs on them outside a hold. PyTorch is imported lazily.
"""
from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from timeslice.logs import get_logger

log = get_logger(__name__)


def module_tensors(module) -> Iterator[Any]:
    """Every parameter and buffer of ``module`` (shared ones once)."""
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def optimizer_tensors(optimizer) -> Iterator[Any]:
    """Every tensor of the optimizer's state (exp_avg, exp_avg_sq, step, ...)."""
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage"):
                yield v


def param_bytes(params) -> int:
    """Bytes of the trainable tensors among ``params`` (each storage once)."""
    seen: dict[int, int] = {}
    for p in params:
        if getattr(p, "requires_grad", False):
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


#: State bytes an optimizer creates per byte of trainable parameter, by class name (lower case):
#: Adam-family keep two moments, SGD one momentum buffer; unknown ones are assumed Adam-like.
STATE_PER_PARAM = {"adam": 2, "adamw": 2, "nadam": 2, "radam": 2, "adamax": 2, "lion": 1, "sgd": 1,
                   "rmsprop": 1, "adagrad": 1, "adafactor": 0}


def expected_state_bytes(optimizer_name: str, params) -> int:
    """What the optimizer will create at its first step (before it has): a planning estimate."""
    name = optimizer_name.lower()
    per = next((n for key, n in sorted(STATE_PER_PARAM.items(), key=lambda kv: -len(kv[0])) if key in name), 2)
    return per * param_bytes(params)


def needs_state(optimizer) -> bool:
    """True if the next ``step()`` creates state: a parameter with a gradient and no state yet."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not optimizer.state.get(p):
                return True
    return False


class ModelRegions:
    """Puts modules and optimizers into ``memory``'s regions (``weights_tag``, ``optimizer_tag``).

    ``worker``: the ``CooperativeWorker`` that ``client.cooperate(memory)`` returned, once
    there is one; a grown region is announced to the agent through it. ``on_grow(tag, seconds)``
    is called after a region grew and its backup was pinned (e.g. to log the pinning time).
    """

    def __init__(self, memory, weights_tag: str = "weights", optimizer_tag: str = "optimizer",
                 worker=None, on_grow: Callable[[str, float], Any] | None = None, clean_between_steps: bool = False):
        for tag in (weights_tag, optimizer_tag):
            if tag not in memory.tags:
                raise ValueError(f"the memory declares no region {tag!r} (it has {sorted(memory.tags)})")
        self.memory, self.weights_tag, self.optimizer_tag = memory, weights_tag, optimizer_tag
        self.worker, self.on_grow = worker, on_grow
        self.expected: dict[str, int] = {}            # tag -> bytes it will hold once complete
        # Clean between steps: only an optimizer step writes the weights and the optimizer state, so
        # between two steps both are unchanged, and a pause there (after a generation) need not copy
        # them out again (timeslice.backup: a promise the checksum checks, where the memory keeps one).
        self.clean = clean_between_steps and hasattr(memory, "writing")

    def expect(self, tag: str, nbytes: int) -> None:
        """Region ``tag`` will hold about ``nbytes`` (e.g. optimizer state not created yet).

        A memory that can size its host backup ahead (``TorchMemory.declare``) is told too, so the
        backup is pinned when the worker cooperates, not inside the first step's hold."""
        self.expected[tag] = max(0, int(nbytes))
        declare = getattr(self.memory, "declare", None)
        if declare is not None and self.memory.tags.get(tag) == "offload":
            declare(tag, self.expected[tag])

    def missing_bytes(self) -> int:
        """Bytes the regions will still grow by, from what was expected of them."""
        have = self.memory.region_bytes()
        return sum(max(0, n - have.get(t, 0)) for t, n in self.expected.items())

    # -- modules -----------------------------------------------------------------------
    def module(self, module, device=None):
        """Move ``module`` to ``device`` inside the weights region (and adopt it); returns it."""
        if device is not None:
            import torch
            target = torch.device(device)
            if target.type == "cuda" and any(t.is_cuda for t in module_tensors(module)):
                log.warning("module_already_on_device", tag=self.weights_tag,
                            hint="tensors allocated outside a region stay on the device after a pause "
                                 "(residue): build the module on the CPU, or inside memory.region()")
            with self.memory.region(self.weights_tag):
                module.to(target)
        self.adopt(self.weights_tag, module_tensors(module))
        if self.clean:
            self.memory.mark_clean(self.weights_tag)   # loaded: unchanged until the first step
        return module

    def adopt(self, tag: str, tensors: Iterable) -> None:
        """Tell a memory that adopts (the CPU stand-in) which tensors are in ``tag``; then announce."""
        adopt = getattr(self.memory, "adopt", None)
        if adopt is not None:
            adopt(tag, list(tensors))
        self._grew(tag)

    # -- optimizers ----------------------------------------------------------------------
    def optimizer(self, optimizer):
        """Run ``optimizer``'s state-creating steps, and its loads, inside the optimizer region."""
        if getattr(optimizer, "_timeslice_placed", False):
            return optimizer
        if not optimizer.state:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.expect(self.optimizer_tag, expected_state_bytes(type(optimizer).__name__, params))
        placement = self
        step, load = optimizer.step, optimizer.load_state_dict

        def placed_step(opt, *args, **kwargs):
            with placement._writing():
                if not needs_state(opt):
                    return step(*args, **kwargs)
                with placement.memory.region(placement.optimizer_tag):
                    out = step(*args, **kwargs)
                placement.adopt(placement.optimizer_tag, optimizer_tensors(opt))
                return out

        def placed_load(opt, *args, **kwargs):
            with placement.memory.region(placement.optimizer_tag):
                out = load(*args, **kwargs)
            placement.adopt(placement.optimizer_tag, optimizer_tensors(opt))
            return out

        # Bound methods, not plain functions: an LR scheduler wraps ``step`` through ``__func__``.
        optimizer.step = types.MethodType(placed_step, optimizer)
        optimizer.load_state_dict = types.MethodType(placed_load, optimizer)
        optimizer._timeslice_placed = True
        return optimizer

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a step: both regions dirty while it writes them, clean again after (``clean_between_steps``)."""
        if not self.clean:
            yield
            return
        with self.memory.writing(self.weights_tag), self.memory.writing(self.optimizer_tag):
            yield

    # -- growth ------------------------------------------------------------------------
    def _grew(self, tag: str) -> None:
        """A region has new bytes: pin their host backup now (we hold the group) and tell the agent."""
        t0 = time.monotonic()
        prepin = getattr(self.memory, "prepin", None)
        if self.worker is not None and prepin is not None and self.memory.tags.get(tag) == "offload":
            prepin([tag])
        if self.worker is not None:
            self.worker.announce(sync=True)            # counted by the agent's report before the hold ends
        if self.on_grow is not None:
            self.on_grow(tag, time.monotonic() - t0)


#: The name this class had until round 4; the README documents it, so it still imports.
Placement = ModelRegions
