"""A fit group's grants, sans-IO: a FIFO weighted semaphore per GPU, each grant weighing its footprint.

A group's sharing policy (``GroupSpec.sharing``) is ``exclusive`` (the lock as it always was:
one holder) or ``fit``. In a fit group every grant weighs, on each GPU it uses, its *admitted
footprint*; a grant that weighs the whole device (the phase asked for the GPUs alone,
``acquire(..., exclusive=True)``, or its footprint is not known) is alone on its GPUs. A lock is this
semaphore with every request weighing the whole device, which is what an exclusive group is.

Admission, per GPU g of the group (``fits``):

    sum over the holders h of footprint(h, g)  +  footprint(head, g)  <=  capacity(g) - margin

with capacity the agent's figure for the device (``AgentValue.gpus[].total_bytes``) and margin the
planner's ``device_margin_bytes``. A GPU whose capacity no agent reports has no room. The plan
also checks what is really free (``reserve``: the holders' room to grow to their footprints is
kept for them), and makes room by parking jobs that hold nothing, as in any group.

The footprint is lockd/footprints.py's ``admitted``: max(declared, observed, seen - context) +
context + margin (+ a first hold's spare), per GPU, as the planner's own fit uses it
(lockd/fitplan.py::weight). A job that neither declares a peak (its Acquire's ``device_bytes_hint``) nor
has reported one (``peak_bytes``) has an unknown footprint, and an unknown footprint weighs the whole
device: nobody is ever granted beside another on a guess (what a job holds between phases says nothing
of its peak).

FIFO: the head (the earliest waiter by arrival; lockd/priority.py for classes) is served first:
granted at once when it fits beside the holders, else the group waits for holders to yield
(exclusive time-slicing, with the swap, for what does not fit). **Backfill** (``may_backfill``): a
later waiter C may be granted before a head A that does not fit only if, for *every* set S of the
current holders that A would fit beside, A still fits beside S and C, judged on the room the holders
give back when they leave (``returnable``: free now plus what they hold, within the capacity). Holders only leave until A is
granted (any other grant before A is a backfill, and satisfies the same rule over the holders then),
so whenever A would have been granted without C, it is granted with C there: C never takes room A
will get. C is granted only as a plain grant (nothing to snapshot, restore or freeze: no swap of
C's can hold A up), and A's grant comes first whenever A fits. An exclusive (or unknown) head fits
beside nobody, so nobody is backfilled past it.

Tokens stay strictly increasing in grant order: a backfilled C overtakes A, so before C's grant the
group's turns token rises to C's and A re-keys above it (lockd/rekey.py), its arrival kept. The
re-key costs A two etcd transactions at most, and only if A's turn comes while it is out.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from timeslice.common.server import records as R
from timeslice.lockd.occupancy import NodeView

#: Holders a backfill is judged against (every subset of them is looked at); past it, no backfill.
MAX_BACKFILL_HOLDERS = 10

Slot = tuple[str, int]          # (node, GPU index)


@dataclass(frozen=True)
class Weight:
    """What a grant weighs: admitted bytes per (node, GPU), or the whole device (``exclusive``)."""

    per_gpu: Mapping[Slot, int] = field(default_factory=dict)
    exclusive: bool = False

    def footprint(self) -> dict[str, int]:
        """As the grant stores it: ``"<node>/<GPU index>"`` -> bytes."""
        return {f"{n}/{g}": int(b) for (n, g), b in sorted(self.per_gpu.items())}

    def on(self, node: str) -> dict[int, int]:
        return {g: b for (n, g), b in self.per_gpu.items() if n == node}


WHOLE = Weight(exclusive=True)


def of_grant(g: R.GrantValue) -> Weight:
    """A holder's weight, as its grant recorded it. A grant with no footprint weighs the whole device
    (an exclusive grant, or one written before footprints were recorded)."""
    if g.exclusive or not g.footprint:
        return WHOLE
    per: dict[Slot, int] = {}
    for where, b in g.footprint.items():
        node, _, idx = str(where).rpartition("/")
        try:
            per[(node, int(idx))] = int(b)
        except ValueError:
            return WHOLE                         # a footprint we cannot read: not knowing is not room
    return Weight(per)


def capacities(views: Iterable[NodeView]) -> dict[Slot, int]:
    """(node, GPU) -> total bytes, as the agents report their devices."""
    return {(v.node, g): b for v in views for g, b in v.total.items()}


def returnable(caps: Mapping[Slot, int], free: Mapping[Slot, int],
               held: Iterable[Mapping[Slot, int]]) -> dict[Slot, int]:
    """Per GPU, the room the holders' leaving gives back at most: free now plus what each holds there,
    never more than the capacity. The backfill rule is judged on it: memory no holder accounts for (a
    process outside the lock, a parked job's residue) does not come back when the holders leave."""
    out = {s: int(free.get(s, 0)) for s in caps}
    for h in held:
        for s, b in h.items():
            if s in out:
                out[s] += int(b)
    return {s: min(int(caps[s]), b) for s, b in out.items()}


def _load(weights: Iterable[Weight]) -> dict[Slot, int]:
    out: dict[Slot, int] = {}
    for w in weights:
        for s, b in w.per_gpu.items():
            out[s] = out.get(s, 0) + b
    return out


def fits(w: Weight, holders: Sequence[Weight], caps: Mapping[Slot, int], margin: int) -> bool:
    """True if ``w`` may be granted beside ``holders`` (see the module's rule)."""
    if not holders:
        return True
    if w.exclusive or any(h.exclusive for h in holders):
        return False
    load = _load(holders)
    return all(s in caps and load.get(s, 0) + b <= caps[s] - margin for s, b in w.per_gpu.items())


def may_backfill(head: Weight, cand: Weight, holders: Sequence[Weight], caps: Mapping[Slot, int],
                 margin: int) -> bool:
    """True if ``cand`` may be granted now, before ``head``, without ever delaying it: ``cand`` fits
    beside the holders, and beside every set of holders that ``head`` fits beside, ``head`` still
    fits with ``cand`` there too."""
    if head.exclusive or cand.exclusive or len(holders) > MAX_BACKFILL_HOLDERS:
        return False
    if not fits(cand, holders, caps, margin):
        return False
    if not set(head.per_gpu) & set(cand.per_gpu):
        return True                              # they share no GPU: cand takes nothing head needs
    for k in range(len(holders) + 1):
        for stay in combinations(holders, k):
            if fits(head, stay, caps, margin) and not fits(head, (*stay, cand), caps, margin):
                return False
    return True


def reserve(holders: Iterable[Weight], node: str, seen: Mapping[str, Mapping[int, int]],
            jobs: Sequence[str]) -> dict[int, int]:
    """Bytes per GPU of ``node`` kept for the holders to grow into: each one's footprint less what it
    holds there now (``seen``: job -> GPU -> bytes, the agent's figures). ``jobs`` names the holders,
    in the order of ``holders``."""
    out: dict[int, int] = {}
    for job, w in zip(jobs, holders):
        have = seen.get(job, {})
        for g, b in w.on(node).items():
            extra = max(0, b - int(have.get(g, 0)))
            if extra:
                out[g] = out.get(g, 0) + extra
    return out
