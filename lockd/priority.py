"""Priority classes, sans-IO: which waiter of a priority group is the head, and what must be written first.

A group created with ``priorities`` lets each Acquire name a class, 0 (the default, lowest) to
``MAX_PRIORITY``. The head is the earliest waiter (by arrival) of the highest class present,
so the queue is FIFO within a class. Aging bounds the wait of a low class: once ``max_overtakes``
grants were made on the group since a waiter joined, or it has waited ``max_wait_ms``, its class
is served first, in arrival order, above every class. A waiter is then granted before anyone
who arrived after it, so at most ``max_overtakes`` later arrivals are ever granted ahead of it.
A group without ``priorities`` is pure FIFO, exactly as before: nothing here is consulted.

The fencing token stays the create revision of the holder's queue key, and tokens stay strictly
increasing in grant order (the agents refuse an intent older than one they acted on:
nodeagent/tokens.py). A later, higher-class waiter H has a larger create revision than the
earlier waiters it overtakes, so those must not be granted under their old keys after H. Hence:

  1. Before the first intent or grant of a head that overtakes a waiter (one whose key lies from
     the group's ``turns`` token, included, up to the head's), the leader raises
     ``groups/<g>/turns``.token to the head's token (``RaiseTurns``), alone, then plans again.
  2. An entry whose key is below ``turns``.token is *stale*: never a head. The leader writes it
     again under a fresh key (lockd/rekey.py: out to ``moving/<job>`` and back in, two guarded
     transactions), so its new create revision is above every token issued so far. Its arrival
     (``since``: its first key's create revision) and its age (``since_grants``, ``enqueued_ms``)
     travel in the value, so its place in its class is kept; the Acquire waiting on it follows it.
  3. Moves come before anything else in a plan; if the class head chosen is stale or moving,
     nobody is granted until it is back: a later waiter of its class never slips past it.
  4. Every grant in a priority group also counts itself in ``turns``.grants (the aging clock),
     in the grant's own transaction, guarded by the ``turns`` key's mod revision.

A holder keeps the head (a grant is never preempted), and so does a waiter whose swap has begun
(an intent carries its token), so a new arrival of a higher class waits for the swap under way.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from timeslice.common.errors import InvalidIdError
from timeslice.common.server import records as R
from timeslice.lockd.index import KV, GroupState

MAX_PRIORITY = 9                       # classes 0..9; 0 is the default and the lowest
DEFAULT_MAX_OVERTAKES = 4              # a priority group's aging bound when CreateGroup names none
MAX_OVERTAKES = 1000
MAX_WAIT_MS = 7 * 24 * 3600 * 1000     # a week


def check_bounds(priorities: bool, max_overtakes: int, max_wait_ms: int) -> tuple[int, int]:
    """The aging bounds a CreateGroup stores (defaults filled in); InvalidIdError if out of range."""
    if not priorities:
        if max_overtakes or max_wait_ms:
            raise InvalidIdError("max_overtakes and max_wait_s need priorities on the group")
        return 0, 0
    if not 0 <= max_overtakes <= MAX_OVERTAKES:
        raise InvalidIdError(f"max_overtakes must be in 1..{MAX_OVERTAKES} (0: the default, "
                             f"{DEFAULT_MAX_OVERTAKES}), got {max_overtakes}")
    if not 0 <= max_wait_ms <= MAX_WAIT_MS:
        raise InvalidIdError(f"max_wait_s must be in 0..{MAX_WAIT_MS // 1000} (0: no time bound)")
    return max_overtakes or DEFAULT_MAX_OVERTAKES, max_wait_ms


def check_priority(spec: R.GroupSpec, priority: int, group: str) -> None:
    """An Acquire's class: 0..MAX_PRIORITY on a priority group, only 0 on any other."""
    if not 0 <= priority <= MAX_PRIORITY:
        raise InvalidIdError(f"priority must be in 0..{MAX_PRIORITY}, got {priority}")
    if priority and not spec.priorities:
        raise InvalidIdError(f"group {group!r} has no priority classes (create it with priorities); "
                             f"priority {priority} refused")


@dataclass(frozen=True)
class Turns:
    token: int = 0
    grants: int = 0
    mod_revision: int = 0              # of the turns key; 0: absent

    def counted(self) -> bytes:
        """The value a grant writes: one more grant."""
        return R.TurnsValue(self.token, self.grants + 1, R.now_ms()).dump()

    def raised(self, token: int) -> bytes:
        return R.TurnsValue(token, self.grants, R.now_ms()).dump()


def turns_of(gs: GroupState) -> Turns:
    if gs.turns is None:
        return Turns()
    v = R.TurnsValue.load(gs.turns.value)
    return Turns(v.token, v.grants, gs.turns.mod_revision)


def stale(gs: GroupState, create_revision: int) -> bool:
    """True if an entry with this key must re-key before it may be granted (it was overtaken)."""
    return create_revision < turns_of(gs).token


@dataclass(frozen=True)
class Head:
    job: str
    kv: KV
    raise_to: int = 0                  # > 0: write turns.token = this before any intent or grant
    ready: bool = True                 # False: the head must re-key first; nothing to do now


@dataclass(frozen=True)
class _Waiter:
    job: str
    kv: KV
    value: R.QueueValue
    moving: bool = False               # its entry is out (lockd/rekey.py): ``since`` is set

    @property
    def arrival(self) -> int:
        return self.value.arrival(self.kv.create_revision)


def _waiters(gs: GroupState) -> list[_Waiter]:
    return [_Waiter(j, kv, R.QueueValue.load(kv.value)) for j, kv in gs.queue.items()] + \
        [_Waiter(j, kv, R.QueueValue.load(kv.value), True) for j, kv in gs.moving.items() if j not in gs.queue]


def _aged(w: _Waiter, spec: R.GroupSpec, turns: Turns, now_ms: int) -> bool:
    by_count = spec.max_overtakes > 0 and turns.grants - w.value.since_grants >= spec.max_overtakes
    by_time = spec.max_wait_ms > 0 and now_ms - w.value.enqueued_ms >= spec.max_wait_ms
    return by_count or by_time


def _class_heads(ws: list[_Waiter], spec: R.GroupSpec, turns: Turns, now_ms: int) -> list[tuple[_Waiter, bool]]:
    """Per class, its earliest arrival, and whether any waiter of the class has aged."""
    heads: dict[int, _Waiter] = {}
    aged: dict[int, bool] = {}
    for w in ws:
        c = w.value.priority
        if c not in heads or w.arrival < heads[c].arrival:
            heads[c] = w
        aged[c] = aged.get(c, False) or _aged(w, spec, turns, now_ms)
    return [(heads[c], aged[c]) for c in heads]


def _rank(w: _Waiter, aged: bool) -> tuple[int, int, int]:
    """Smaller goes first: aged classes (by arrival), then the highest class."""
    return (0, 0, w.arrival) if aged else (1, -w.value.priority, w.arrival)


def head_of(gs: GroupState, spec: R.GroupSpec, now_ms: int, swap_tokens: Iterable[int] = (),
            holders: Collection[str] = ()) -> Head | None:
    """The head of a priority group, or of a fit group (None: nobody waits). ``swap_tokens``: the
    tokens of the intents on the group's nodes (a waiter whose swap has begun keeps its turn);
    ``holders``: a fit group's holders, left out (the head is the next waiter to serve beside them;
    a fit group without classes is all class 0: the earliest arrival, lockd/fitplan.py)."""
    if not any(j not in holders for j in gs.queue):
        return None
    if gs.grant is not None:
        g = R.GrantValue.load(gs.grant.value)
        kv = gs.queue.get(g.job)
        if kv is not None and kv.create_revision == g.token:
            return Head(g.job, kv)                         # a holder is never preempted
    turns = turns_of(gs)
    begun = set(swap_tokens)
    for j, kv in gs.queue.items():
        if j not in holders and kv.create_revision in begun and kv.create_revision >= turns.token:
            return Head(j, kv)                             # its swap is under way: let it finish
    heads = _class_heads([w for w in _waiters(gs) if w.job not in holders], spec, turns, now_ms)
    w, _ = min(heads, key=lambda h: _rank(*h))
    tok = w.kv.create_revision
    if w.moving or tok < turns.token:
        return Head(w.job, w.kv, ready=False)              # overtaken before: it re-keys, then goes
    # Any other key from the turns token up (that one included: an earlier raise's head not granted
    # yet) to ours is overtaken: granted after us, its token would be smaller than ours.
    overtakes = any(turns.token <= kv.create_revision < tok for j, kv in gs.queue.items()
                    if j != w.job and j not in holders)
    return Head(w.job, w.kv, raise_to=tok if overtakes else 0)


def planned_head(gs: GroupState, now_ms: int) -> tuple[str, KV] | None:
    """The head as the planner picks it (FIFO groups: the oldest entry; a fit group: the next waiter
    beside its holders), for metrics and traces (no swap under way is looked at)."""
    if gs.parsed is None or not (gs.parsed.priorities or gs.parsed.shared):
        return gs.head()
    h = head_of(gs, gs.parsed, now_ms, holders=gs.holders() if gs.parsed.shared else ())
    return (h.job, h.kv) if h is not None and h.ready else None


def order(gs: GroupState, spec: R.GroupSpec, now_ms: int, holders: Collection[str] = ()) -> list[tuple[str, KV]]:
    """The queue as it will be served, for status (holder first): by the rule above, without
    simulating the aging of the waits to come. ``holders``: a fit group's, left out of the order."""
    turns = turns_of(gs)
    ws = [w for w in _waiters(gs) if w.job not in holders]
    aged_class: dict[int, bool] = {}
    for w in ws:
        aged_class[w.value.priority] = aged_class.get(w.value.priority, False) or _aged(w, spec, turns, now_ms)
    holder = head_of(gs, spec, now_ms, holders=holders)
    first = [w for w in ws if holder is not None and w.job == holder.job and not w.moving]
    rest = sorted((w for w in ws if not first or w.job != first[0].job),
                  key=lambda w: _rank(w, aged_class[w.value.priority]))
    return [(w.job, w.kv) for w in first + rest]
