"""The backfill rule, driven: a fit group's planner (lockd/fitplan.py) run over long random histories of
arrivals, cancellations and yields on one 80 GB GPU, every action it plans applied as the scheduler
would (turns raised, entries moved under fresh keys, grants written, stale grants dropped).

The rule (lockd/weights.py): a later waiter may be granted before a head that does not fit only if this
cannot delay the head. Checked at every step, independently of the planner's arithmetic (the footprints
here are the declarations exactly):

* the head fits beside the backfills granted while it was the head (so they never keep it waiting);
* the head is never kept waiting longer than the holders it found when it became the head: once they
  have all left, it holds, whatever was backfilled meanwhile (it is never starved);
* a head that fits beside the holders holds (FIFO: the head goes first whenever it fits);
* nothing is backfilled past an exclusive (or undeclared) head; tokens increase in grant order.
"""
from __future__ import annotations

import random

import pytest

from tests.lockd.test_fitplan import EXACT, SPEC, GB, held_by, node
from tests.lockd.test_plan import kv, worker_on
from timeslice.common.server import records as R
from timeslice.lockd import plan as P
from timeslice.lockd import rekey as RK
from timeslice.lockd.index import GroupState, JobState

CAP = 80                          # GB, as node() reports the GPU
HINTS = (5, 10, 15, 20, 30, 40, 50, 70)


class Sim:
    """One fit group as etcd would hold it, with a revision counter; ``settle`` applies plans until the
    planner has nothing more to do, checking the rule after every plan."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.rev = 10
        self.gs = GroupState(spec=kv("spec", SPEC), parsed=SPEC)
        self.js: dict[str, JobState] = {}
        self.want: dict[str, tuple[int, bool]] = {}          # job -> (GB declared, exclusive)
        self.high = 0                                        # the highest token granted
        self.head: str | None = None
        self.found: set[str] = set()                         # holders when the head became the head
        self.backfilled_past: set[str] = set()               # backfills granted while it was the head
        self.backfills = self.heads_after_backfill = 0
        self.n = 0

    def next_rev(self) -> int:
        self.rev += 1
        return self.rev

    # -- the world's events ----------------------------------------------------------------------
    def arrive(self) -> None:
        self.n += 1
        job = f"j{self.n}"
        gb = self.rng.choice(HINTS)
        excl = self.rng.random() < 0.08
        undeclared = self.rng.random() < 0.04
        r = self.next_rev()
        value = R.QueueValue(job, 1000 + self.n, 0 if undeclared else gb * GB, exclusive=excl)
        self.gs.queue[job] = kv(f"q/{job}", value, create=r, lease=1000 + self.n)
        self.js[job] = JobState(session=kv("s", b"{}"), workers=worker_on(job, self.n, gpus=(0,)))
        self.want[job] = (gb, excl or undeclared)

    def leave(self, job: str) -> None:
        """A holder yields, or a waiter cancels: its entry goes (its grant, if any, the planner drops)."""
        self.gs.queue.pop(job, None)
        self.gs.moving.pop(job, None)
        self.next_rev()

    # -- the planner, applied ------------------------------------------------------------------
    def settle(self) -> None:
        for _ in range(50):
            acts = P.plan_group(self.gs, node(CAP), self.js, 0, EXACT, holding=held_by(self.gs))
            self.check_plan(acts)
            if not acts:
                self.check_quiet()
                return
            for a in acts:
                self.apply(a)
        raise AssertionError("the planner never settled")

    def apply(self, a) -> None:
        gs, r = self.gs, self.next_rev()
        if isinstance(a, P.RaiseTurns):
            gs.turns = kv("turns", a.value, create=gs.turns.create_revision if gs.turns else r, mod=r)
        elif isinstance(a, RK.MoveOut):
            del gs.queue[a.job]
            gs.moving[a.job] = kv(f"moving/{a.job}", a.value, create=r, lease=a.lease)
        elif isinstance(a, RK.MoveIn):
            del gs.moving[a.job]
            gs.queue[a.job] = kv(f"q/{a.job}", a.value, create=r, lease=a.lease)
        elif isinstance(a, RK.DropMarker):
            del gs.moving[a.job]
        elif isinstance(a, P.DropGrant):
            del gs.shared[a.job]
        elif isinstance(a, P.WriteGrant):
            assert a.token > self.high, f"token {a.token} granted after {self.high}"
            self.high = a.token
            gs.shared[a.job] = kv(f"grants/{a.job}", a.stored(7), create=r)
            if a.backfilled:
                assert a.job != self.head
                self.backfills += 1
                self.backfilled_past.add(a.job)
        else:
            raise AssertionError(f"no swap expected with the device free: {a}")

    # -- the rule --------------------------------------------------------------------------------
    def holders(self) -> set[str]:
        return {j for j, g in self.gs.shared.items() if j in self.gs.queue
                and self.gs.queue[j].create_revision == R.GrantValue.load(g.value).token}

    def waiting_head(self) -> str | None:
        """The earliest arrival among the waiters (queued or being moved), by our own reading."""
        held = self.holders()
        ws = [(R.QueueValue.load(k.value).arrival(k.create_revision), j)
              for src in (self.gs.queue, self.gs.moving) for j, k in src.items() if j not in held]
        return min(ws)[1] if ws else None

    def fits(self, job: str, beside: set[str]) -> bool:
        gb, whole = self.want[job]
        if not beside:
            return True
        if whole or any(self.want[b][1] for b in beside):
            return False
        return gb + sum(self.want[b][0] for b in beside) <= CAP

    def check_plan(self, acts) -> None:
        head = self.waiting_head()
        if head != self.head:
            if self.head is not None and self.backfilled_past and self.head in self.holders():
                self.heads_after_backfill += 1
            self.head, self.found, self.backfilled_past = head, self.holders(), set()
        if head is None:
            return
        past = self.backfilled_past & self.holders()
        assert self.fits(head, past), (f"head {head} {self.want[head]} does not fit beside what was backfilled "
                                       f"past it: {[(b, self.want[b]) for b in sorted(past)]}")
        self.found &= self.holders()                         # the holders it found only leave

    def check_quiet(self) -> None:
        head = self.waiting_head()
        if head is None:
            return
        held = self.holders()
        assert not self.fits(head, held), f"head {head} fits beside {sorted(held)} and still waits"
        assert self.found & held, (f"head {head} waits although every holder it found has left; "
                                   f"the holders now are backfills past it: {sorted(held)}")


@pytest.mark.parametrize("seed", range(3))
def test_a_head_is_never_delayed_by_a_backfill_and_never_starved(seed):
    sim = Sim(seed)
    for _ in range(400):
        held, waiting = sim.holders(), [j for j in sim.gs.queue if j not in sim.holders()]
        x = sim.rng.random()
        if x < 0.45 or not (held or waiting):
            sim.arrive()
        elif x < 0.93 and held:
            sim.leave(sim.rng.choice(sorted(held)))
        elif waiting:
            sim.leave(sim.rng.choice(waiting))
        sim.settle()
    # Drain: nobody arrives any more; holders leave one by one and every waiter is granted in the end.
    while sim.gs.queue:
        held = sorted(sim.holders())
        assert held, f"waiters {sorted(sim.gs.queue)} and nobody holding: starved"
        sim.leave(held[0])
        sim.settle()
    # The histories did what the rule is about: backfills past heads that were granted afterwards.
    assert sim.backfills >= 5 and sim.heads_after_backfill >= 2, (sim.backfills, sim.heads_after_backfill)
