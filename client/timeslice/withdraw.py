"""Taking back an Acquire that failed without proof that lockd dropped it. Sans-IO.

An ``acquire()`` that ends in an error such as UNAVAILABLE (every replica failed
for the whole failover window) or a deadline the client noticed before lockd
did may leave the job's queue entry in etcd: the replica that held the call
died with it, and the session lives on (its keepalives reach a replica again).
The entry would then be granted to nobody: a ghost holder, until the session
ends. So the client *withdraws*: it sends one more, short Acquire (a newer
``attempt_seq``, deadline ``ATTEMPT_S``) to whatever replica answers. lockd
either grants it at once (the client yields the grant straight back) or gives
the place up when the deadline passes; either way nothing of the job is left in
the group. The first try is made before ``acquire()`` raises (``FIRST_BUDGET_S``);
if lockd cannot be reached, the keepalive loop retries after each renewal that
succeeds, until done. A new ``acquire()`` of the group cancels the withdrawal.
"""
from __future__ import annotations

import enum

#: Deadline of one withdrawing Acquire (lockd keeps a 50 ms margin to give the place up).
ATTEMPT_S = 0.5
#: How long acquire() tries to withdraw before it raises.
FIRST_BUDGET_S = 2.0
#: Errors of a failed acquire() after which the entry may still be in etcd.
MAYBE_LEFT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL"})
#: lockd's own AcquireTimeout says it gave the place up (lockd/locks.py).
GIVEN_UP = "place in the queue was given up"


class Verdict(enum.Enum):
    DONE = "done"        # nothing of the job is left in the group
    GRANTED = "granted"  # lockd granted the withdrawing call: yield it, then done
    RETRY = "retry"      # no answer: fail over and try again


def needs_withdraw(code: str | None, details: str) -> bool:
    """Whether a failed acquire() may have left the job's entry behind."""
    return code in MAYBE_LEFT and GIVEN_UP not in (details or "")


def verdict(code: str | None, details: str = "") -> Verdict:
    """What one withdrawing Acquire's outcome means (``code`` None: it returned a grant)."""
    if code is None:
        return Verdict.GRANTED
    if code == "DEADLINE_EXCEEDED" and GIVEN_UP in (details or ""):
        return Verdict.DONE
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL"):
        return Verdict.RETRY
    # ABORTED / UNAUTHENTICATED: the session (and all it owned) is gone; NOT_FOUND: the
    # group is; CANCELLED: a newer attempt owns the entry; RESOURCE_EXHAUSTED: lockd
    # removed the entry itself. Nothing is left to take back.
    return Verdict.DONE
