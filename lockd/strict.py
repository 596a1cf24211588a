"""Strict groups and frozen jobs in the plan, sans-IO (see lockd.plan).

An elided handoff leaves the yielded job resident beside the new holder: the
lease lock says it must not run, but the GPU checks no token, so a stray
kernel of the yielded job (a thread the job forgot, a process that missed its
yield) would run beside the holder's. A group created with
``isolation="strict"`` closes that: before the grant, every other job with a
device context on the group's GPUs of a node is *frozen* there (a freeze
intent: the agent takes the driver's process lock, the simulator's on the
simulated device; nothing is copied) or snapshotted (when room is needed, as
in any group). The grant waits for the agent's answers, fenced and revisioned
like every intent. A frozen job runs nothing on any GPU until it acquires
again: then, in any group, its thaw intent is answered before its grant.

Never frozen: a job that holds a group on those devices (it is running there
by right: the same rule that never snapshots a holder); a job frozen already;
a job whose freeze for this very grant (token) was answered ok.

The freeze is per job and node (all its processes there, as a snapshot is): a
job with processes on GPUs outside the group on that node is frozen there too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from timeslice.common.server import records as R
from timeslice.lockd.index import NodeState, status_of
from timeslice.lockd.occupancy import NodeView, is_protected


def is_frozen(ns: NodeState | None, job: str) -> bool:
    """True if the agent reports ``job`` frozen on this node (every process locked in place)."""
    st = status_of(ns, job)
    return st is not None and st.state == R.FROZEN


def _frozen_for(ns: NodeState | None, job: str, token: int) -> bool:
    """True if a freeze of ``job`` serving grant ``token`` was answered ok here."""
    kv = ns.intents.get(job) if ns else None
    st = status_of(ns, job)
    if kv is None or st is None:
        return False
    intent = R.IntentValue.load(kv.value)
    return (intent.op == R.FREEZE and intent.token == token and st.intent_revision == kv.mod_revision
            and st.outcome == R.OK)


def to_freeze(isolation: str, ns: NodeState | None, node: str, group_gpus: frozenset[int],
              residents: dict[str, frozenset[int]], token: int, view: NodeView,
              holding: Callable[[str], Iterable[R.GroupSpec]] | None) -> list[str]:
    """The residents of a strict group's GPUs here that must be frozen before grant ``token``."""
    if not R.freezes_elided(isolation):
        return []
    return sorted(j for j, gpus in residents.items()
                  if gpus & group_gpus and not is_frozen(ns, j) and not _frozen_for(ns, j, token)
                  and not is_protected(j, node, gpus, view, holding))
