"""Where each job is on a node, for the planner, sans-IO: from the agent's statuses and its report.

The status a node's agent wrote for a job is the last known truth about its
memory (a job's memory moves only when the agent moves it, and the agent says
"in progress" before it starts); the agent's liveness key adds what it sees
now: the jobs with memory on its devices (``AgentValue.job_device_bytes``) and
those whose state it cannot read (``AgentValue.job_unknown``).
"""
from __future__ import annotations

from timeslice.common.server import records as R
from timeslice.lockd import strict as S
from timeslice.lockd.index import JobState, NodeState, status_of
from timeslice.lockd.occupancy import NodeView

RESIDENT = ("running", "partial", "unknown")      # residencies that hold memory on the device


def residency(ns: NodeState | None, job: str, on_node: bool, agent: R.AgentValue | None = None) -> str:
    """Where a job's context is on a node: running | partial | unknown | snapshotted | gone | absent.

    ``partial``: parked (snapshotted) with memory left on the device, as the agent reports it: a
    cooperative worker whose selective pause kept some regions there. The others must count it
    resident (a further snapshot frees the rest); for itself it is a snapshot to restore.
    ``unknown``: the agent cannot read its state now (a cooperative worker not reconnected to it,
    ``AgentValue.job_unknown``; a status "unknown"). The others count it resident with its
    registered footprint; it is never granted before the agent answered a restore for it.
    """
    st = status_of(ns, job)
    if not on_node:
        return "absent"
    if st is not None and st.state == R.UNKNOWN:
        return "unknown"
    if st is None or st.state in (R.RUNNING, R.SNAPSHOTTING, R.FROZEN):
        # A context on the device (frozen: locked there); its last known state, unless the agent says
        # it cannot tell any more.
        return "unknown" if agent is not None and job in agent.job_unknown else "running"
    if st.state in (R.SNAPSHOTTED, R.RESTORING):
        return "partial" if agent is not None and agent.job_device_bytes.get(job, 0) > 0 else "snapshotted"
    return "gone"                                         # gone or lost: nothing to move


#: Status states whose job may still have memory on the node's devices (or, for a job's own, memory not
#: back): what only the agent could say otherwise.
_MAYBE_THERE = (R.RUNNING, R.SNAPSHOTTING, R.FROZEN, R.UNKNOWN, R.RESTORING)


def unreported_memory(ns: NodeState | None, head_job: str) -> list[str]:
    """Jobs whose last status on a node whose agent is not alive says their memory may be on its devices,
    registered there or not (a job whose session was replaced while its process lived on keeps its memory
    there, unregistered); and the head itself if its status says anything but gone: parked, its memory is
    not back, and only the agent can bring it back. Granting past them would promise a device nobody can
    vouch for (the agent-kill chaos run saw a grant land on a full device)."""
    out = []
    for job in sorted(ns.statuses if ns is not None else ()):
        st = status_of(ns, job)
        if st is None:
            continue
        if st.state in _MAYBE_THERE or (job == head_job and st.state not in (R.GONE, R.LOST)):
            out.append(job)
    return out


def unfenced(agent: R.AgentValue, node: str, head_job: str, jobs: dict[str, JobState],
             ns: NodeState | None = None) -> list[str]:
    """Jobs on ``node``'s devices (per its agent) that lost their registrations and are not frozen yet
    (a parked one runs nothing: what it left on the device is a resident's, ``parked_left``)."""
    return sorted(j for j, b in agent.job_device_bytes.items()
                  if b and j != head_job and node not in (jobs[j].nodes() if j in jobs else ())
                  and not S.is_frozen(ns, j) and not _parked(ns, j))


def parked_left(ns: NodeState | None, agent: R.AgentValue | None, on_node: set[str]) -> set[str]:
    """Parked jobs without registrations here that the agent reports with memory on the devices:
    residents too (a job whose session went while a partial pause kept some of its regions there;
    the agent moves them through the worker's own channel)."""
    return {j for j, b in (agent.job_device_bytes.items() if agent else ()) if b and j not in on_node
            and _parked(ns, j)}


def _parked(ns: NodeState | None, job: str) -> bool:
    st = status_of(ns, job)
    return st is not None and st.state in (R.SNAPSHOTTED, R.RESTORING)


def residue_holders(view: NodeView, ns: NodeState | None, where: dict[str, str], jobs: dict[str, JobState],
                    gpus: set[int] | frozenset[int], isolation: str) -> list[str]:
    """Parked jobs on ``gpus`` whose cooperative pause left device memory outside their regions
    (``StatusValue.residue_bytes``, the worker's own measure), and whose residue the checkpoint of
    full isolation may take: none in a group that checkpoints it at every pause already, and never
    a job with a ``collective`` worker (a driver restore of a CUDA IPC / NCCL context loses it)."""
    out = []
    for j, w in sorted(where.items()):
        st = status_of(ns, j)
        if w != "snapshotted" or st is None or st.residue_bytes <= 0:
            continue
        js = jobs.get(j)
        if not may_checkpoint_rest(view, js, isolation):
            continue
        on = view.known_gpus(j, js, st) or view.all_gpus
        if on & set(gpus):
            out.append(j)
    return out


def may_checkpoint_rest(view: NodeView, js: JobState | None, isolation: str) -> bool:
    """May the checkpoint of full isolation take what a job keeps outside its regions? Not in a
    group that checkpoints it at every pause already; never for a job with a ``collective``
    worker (a driver restore of a CUDA IPC / NCCL context loses it)."""
    return not R.checkpoints_rest(isolation) and not any(wk.collective for wk in view.workers(js))
