"""Which registered pids the agent will act on: those the job has *attested* over the channel.

RegisterWorker goes through lockd, which cannot see the node's processes: a job could
name any pid there, another job's worker included. The node-local channel closes that
gap. A job's process that opens it is known to the agent by the kernel's word
(``SO_PEERCRED``) and by the job's session secret; the client library opens it when it
registers a worker (``Workers.attest_worker`` in ``timeslice.workers``). A registered pid is the job's
when the pid itself, or one of its ancestors (a launcher that starts its ranks), holds
such a connection for that job — on Kubernetes with a hostPID agent, the pod's
processes descend from the container's, so the rule holds there too.

With ``--require-attestation`` (on in deploy/ and the local launcher) the agent ignores
unattested registrations — never snapshots, restores or counts them — and says so once
per pid. Without it (the test harness default, for tests that register processes they
start from outside), attestation is still checked and a registration that another job
attested is ignored: an attested process is never acted on for a job that is not its own.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from timeslice.common import procfs

MAX_DEPTH = 64           # ancestors looked at; process trees are shallow


def owner(pid: int, job_of: Callable[[int], str | None], proc_root: str | os.PathLike = procfs.PROC_ROOT
          ) -> str | None:
    """The job that attested ``pid`` (itself or its nearest attested ancestor), or None."""
    seen = 0
    cur: int | None = pid
    while cur and cur > 1 and seen < MAX_DEPTH:
        job = job_of(cur)
        if job is not None:
            return job
        cur = procfs.parent_pid(cur, proc_root)
        seen += 1
    return None


def trusted(job: str, pids: Iterable[int], job_of: Callable[[int], str | None], required: bool,
            proc_root: str | os.PathLike = procfs.PROC_ROOT) -> tuple[list[int], dict[int, str]]:
    """(pids to act on for ``job``, {pid: why not} for the others)."""
    keep, refused = [], {}
    for pid in pids:
        who = owner(pid, job_of, proc_root)
        if who == job or (who is None and not required):
            keep.append(pid)
        elif who is None:
            refused[pid] = "not attested: no process of the job opened the node agent's channel for it"
        else:
            refused[pid] = "attested by another job"
    return keep, refused
