"""The leader writes an overtaken waiter's queue entry again under a fresh key (priority groups, fit groups).

A grant ahead of earlier waiters raised the group's turns token above their keys
(lockd/priority.py; in a fit group a backfill, lockd/fitplan.py): granted under those old keys, they would get tokens smaller than one
already issued, and the agents refuse those (nodeagent/tokens.py). So the leader moves each
such entry, in two transactions, since etcd refuses a delete and a put of one key in one:

    MoveOut  If  create_revision(entry) == its key, mod_revision(entry) == as planned
             Then put moving/<job> = the value with its arrival kept (leased like the entry);
                  delete the entry                                            (one revision)
    MoveIn   If  create_revision(entry) == 0, mod_revision(moving/<job>) == as planned,
                 create_revision(spec) == the group's incarnation
             Then put the entry = moving/<job>'s value, leased like it; delete moving/<job>

So at every revision the job is either queued or ``moving``: nobody plans on a queue it has
left, and a leader that dies between the two leaves the marker to the next one, which moves
the entry in (the plan's input is what etcd holds). A marker beside an entry (a re-sent
Acquire joined again while it was out) is dropped: the entry wins.

The moved value is a function of the waiter's own value and first key (``moved_value``), so
the Acquire call waiting on it recognises its entry under the new key (and takes its token)
and, if cancelled, finds and removes it wherever it is (lockd/locks.py).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.keys import Keys


def movable(spec: R.GroupSpec) -> bool:
    """True for a group whose waiters the leader may move: priority classes, or a fit group (a backfill
    overtakes the head: lockd/fitplan.py)."""
    return spec.priorities or spec.shared


def moved_value(value: bytes, token: int) -> bytes:
    """A waiter's value as a move writes it: its arrival (its first key's revision) kept. Moving
    it again writes the same bytes."""
    v = R.QueueValue.load(value)
    if v.since:
        return value
    v.since = token
    return v.dump()


@dataclass(frozen=True)
class MoveOut:
    job: str
    token: int                              # the entry's create revision (its old key)
    mod_revision: int
    lease: int
    value: bytes = field(compare=False)     # moved_value of the entry's


@dataclass(frozen=True)
class MoveIn:
    job: str
    mod_revision: int                       # of moving/<job>
    lease: int
    value: bytes = field(compare=False)


@dataclass(frozen=True)
class DropMarker:
    job: str
    mod_revision: int


Move = MoveOut | MoveIn | DropMarker


def txn(keys: Keys, group: str, a: Move, spec_rev: int) -> tuple[list[rpc.Compare], list[rpc.RequestOp]]:
    """The guarded transaction of one move step (run under the leader's epoch guard)."""
    qkey, mkey = keys.queue_entry(group, a.job), keys.moving(group, a.job)
    if isinstance(a, MoveOut):
        # Only the entry as planned (its key, its value's version): a re-sent Acquire that rewrote
        # it meanwhile, or its removal, makes the leader plan again. Marker and delete in one revision.
        return ([ops.create_rev(qkey, "==", a.token), ops.mod_rev(qkey, "==", a.mod_revision)],
                [ops.put(mkey, a.value, a.lease), ops.delete(qkey)])
    if isinstance(a, MoveIn):
        # Create-if-absent (a re-sent Acquire may have joined again: then the marker is dropped
        # instead), only over the marker as planned, and never into a group deleted meanwhile.
        return ([ops.create_rev(qkey, "==", 0), ops.mod_rev(mkey, "==", a.mod_revision),
                 ops.create_rev(keys.spec(group), "==", spec_rev)],
                [ops.put(qkey, a.value, a.lease), ops.delete(mkey)])
    # DropMarker: the job is queued again by itself; the marker as planned goes.
    return [ops.mod_rev(mkey, "==", a.mod_revision), ops.create_rev(qkey, ">", 0)], [ops.delete(mkey)]


def moves(queue: dict, moving: dict, below: int, holders: Collection[tuple[str, int]] = ()) -> list[Move]:
    """What to move now: entries with keys below ``below`` (the turns token) out, markers in.
    ``holders``: (job, token) of each grant, never moved (its key is a token already issued)."""
    out: list[Move] = []
    for job, kv in queue.items():
        if kv.create_revision < below and job not in moving and (job, kv.create_revision) not in holders:
            out.append(MoveOut(job, kv.create_revision, kv.mod_revision, kv.lease,
                               moved_value(kv.value, kv.create_revision)))
    for job, mk in moving.items():
        out.append(DropMarker(job, mk.mod_revision) if job in queue else MoveIn(job, mk.mod_revision, mk.lease, mk.value))
    return out
