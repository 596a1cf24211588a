"""Housekeeping, sans-IO: which intent and status keys of departed jobs can go.

Intents and statuses are durable (a leader or agent crash must not lose
them), so nothing deletes them with a lease. Once a job is gone — no session,
no queue entry anywhere — its *answered* intents and its statuses that hold
nothing (running, gone, lost) are garbage. A ``snapshotted`` status is kept:
it is the record of a context still parked in host memory. Each delete is
guarded by the key's mod revision, so a concurrent rewrite is never lost.
"""
from __future__ import annotations

from dataclasses import dataclass

from timeslice.common.server import records as R
from timeslice.lockd.index import GroupState, JobState, NodeState

_EMPTY = frozenset({R.RUNNING, R.GONE, R.LOST})


@dataclass(frozen=True)
class Forget:
    key: bytes
    mod_revision: int


def plan_cleanup(groups: dict[str, GroupState], nodes: dict[str, NodeState],
                 jobs: dict[str, JobState]) -> list[Forget]:
    present = {j for j, js in jobs.items() if js.session is not None}
    for gs in groups.values():
        present.update(gs.queue)
    out: list[Forget] = []
    for ns in nodes.values():
        for job, ikv in ns.intents.items():
            if job in present:
                continue
            skv = ns.statuses.get(job)
            st = R.StatusValue.load(skv.value) if skv else None
            if st is not None and st.intent_revision == ikv.mod_revision and st.outcome:
                out.append(Forget(ikv.key, ikv.mod_revision))
        for job, skv in ns.statuses.items():
            if job in present or job in ns.intents:
                continue                      # its intent goes first (the agent answers intents)
            if R.StatusValue.load(skv.value).state in _EMPTY:
                out.append(Forget(skv.key, skv.mod_revision))
    return out
