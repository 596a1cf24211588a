"""What a grant must leave usable for its holder, per job and GPU: the footprint rule, sans-IO.

A grant is a promise that its holder can run its phase on the GPU. What the job
declared (its Acquire's ``device_bytes_hint``) is only a floor: a phase also
needs its CUDA context, the memory outside the allocator (workspaces, loaded
kernels) and the allocator's slack, and a declaration is often a little short.
So the planner admits, on each GPU ``g`` of the job on a node:

    admitted(g) = max(declared, observed, seen - context) + context + margin   (+ spare on a first hold)

* ``declared``: the Acquire's hint, per node, spread evenly over the job's GPUs there;
* ``observed``: the largest allocator peak the job measured in a hold of the group
  (``torch.cuda.max_memory_reserved`` since the grant, on the simulated device the
  runtime's own figure), sent with its next Acquire (``peak_bytes``);
* ``seen``: the most the node's meter (NVML, per process) shows the job holding there
  now or recorded at its snapshot: the check on the job's own word;
* ``context``: the job's measured memory outside its allocator (NVML's figure for the
  process less the allocator's reservation, measured at its yield: ``context_bytes``),
  else what its last cooperative pause left on the device (the residue holds the
  context), else ``context_fraction`` of the GPU: 612 MiB of the H200's 140 GiB,
  measured per process with nothing allocated (docs: README, "Memory a grant admits");
* ``margin``: ``margin_fraction`` of the rest: the allocator's slack and the phase to
  phase spread (a longer generation, the next temporary);
* ``spare``: a job that declared a peak and has no observed one yet (its first hold)
  is granted only where ``first_hold_spare`` more fits, else the parked jobs' residue
  on those GPUs goes first (``lockd.plan``): a declaration 20% short still runs its
  first phase. A job that neither declares nor reports is planned on what the meter
  saw of it (a snapshot's size), with the margin.

``admitted`` is the one function both the planner's fit (``lockd.occupancy.need_per_gpu``)
and weighted grants build on; its inputs are a ``Footprint`` (what is known of one job
on one node, per GPU index) and a ``FootprintPolicy``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The H200 figures behind the defaults (the README, "Memory a grant admits"):
# a PyTorch process with nothing allocated holds 612 MiB (NVML) of a 143,771 MiB device; a paused
# cooperative job keeps 1.4-1.8 GiB; a process with 44.0 GiB allocated had 45.16 GiB in use.
H200_CONTEXT_BYTES = 612 << 20
H200_TOTAL_BYTES = 143_771 << 20


@dataclass(frozen=True)
class FootprintPolicy:
    context_fraction: float = H200_CONTEXT_BYTES / H200_TOTAL_BYTES   # unmeasured context, share of the GPU
    margin_fraction: float = 0.02          # allocator slack and spread beyond the peak
    first_hold_spare: float = 0.25         # more asked of a first hold (a declaration 20% short: 1/0.8 = 1.25)

    def __post_init__(self) -> None:
        for name in ("context_fraction", "margin_fraction", "first_hold_spare"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


DEFAULT_POLICY = FootprintPolicy()


@dataclass(frozen=True)
class Footprint:
    """What is known of one job's device memory on one node, per GPU index (bytes)."""

    declared: Mapping[int, int] = field(default_factory=dict)   # the hint's share
    observed: Mapping[int, int] = field(default_factory=dict)   # the largest allocator peak reported
    context: Mapping[int, int] = field(default_factory=dict)    # measured memory outside the allocator
    seen: Mapping[int, int] = field(default_factory=dict)       # the meter's figure for the job there
    capacity: Mapping[int, int] = field(default_factory=dict)   # the GPU's total (for an unmeasured context)

    @property
    def first_hold(self) -> bool:
        """A peak declared and none observed yet: the job's first hold of the group (or a client
        that does not measure): the declaration is all there is to go on."""
        return not any(n > 0 for n in self.observed.values()) and any(n > 0 for n in self.declared.values())

    def known(self, gpu: int) -> bool:
        """Something says what the job needs on ``gpu`` (a declaration, a measure or the meter)."""
        return any(m.get(gpu, 0) > 0 for m in (self.declared, self.observed, self.seen))

    def gpus(self) -> frozenset[int]:
        return frozenset(g for m in (self.declared, self.observed, self.seen) for g, n in m.items() if n > 0)


def context_of(fp: Footprint, gpu: int, policy: FootprintPolicy = DEFAULT_POLICY) -> int:
    """The job's memory outside its allocator on ``gpu``: measured, else a share of the GPU."""
    measured = fp.context.get(gpu, 0)
    if measured > 0:
        return measured
    return int(fp.capacity.get(gpu, 0) * policy.context_fraction)


def admitted(fp: Footprint, gpu: int, policy: FootprintPolicy = DEFAULT_POLICY) -> int:
    """Bytes a grant to the job must leave usable on GPU ``gpu`` (the module's rule).

    A footprint not ``known`` on ``gpu`` (nothing declared, measured or seen) weighs the whole
    GPU where its capacity is known (0 where not): not knowing is not room."""
    if not fp.known(gpu):
        return fp.capacity.get(gpu, 0)
    ctx = context_of(fp, gpu, policy)
    base = max(fp.declared.get(gpu, 0), fp.observed.get(gpu, 0), fp.seen.get(gpu, 0) - ctx, 0)
    total = base + ctx
    total += int(total * policy.margin_fraction)
    if fp.first_hold:
        total += int(total * policy.first_hold_spare)
    return total


def spread(total: int, gpus: Iterable[int]) -> dict[int, int]:
    """``total`` bytes spread evenly (rounded up) over ``gpus``."""
    gpus = sorted(gpus)
    if not gpus or total <= 0:
        return {}
    share = -(-total // len(gpus))
    return {g: share for g in gpus}


def footprint(gpus: Iterable[int], *, hint: int = 0, peak: int = 0, context: int = 0,
              seen: Mapping[int, int] | None = None, residue: Mapping[int, int] | None = None,
              capacity: Mapping[int, int] | None = None) -> Footprint:
    """A job's ``Footprint`` on one node from what etcd holds: the queue entry's per-node figures
    (``hint``, ``peak``, ``context``: spread over ``gpus``), the meter's per-GPU figures
    (``seen``), the residue its last pause left per GPU (``residue``: stands for an unmeasured
    context) and the GPUs' capacities."""
    gpus = frozenset(gpus)
    ctx = spread(context, gpus)
    for g, n in (residue or {}).items():
        if n > ctx.get(g, 0) and context <= 0:
            ctx[g] = n
    return Footprint(declared=spread(hint, gpus), observed=spread(peak, gpus), context=ctx,
                     seen={g: n for g, n in (seen or {}).items() if n > 0},
                     capacity=dict(capacity or {}))
