"""What a grant was planned on, as compares its transaction makes: where the head's memory is, as planned.

A plan is made on a replica's mirror (the leader's for the scheduler, the Yield's replica for a
direct handoff), and a mirror may lag etcd: a replica whose etcd member stalls keeps its watch
there for seconds, a new leader plans at once on what its mirror had. A grant planned on a
picture in which the head is running on its GPUs while etcd already says it was snapshotted
(an intent of the leader before, answered meanwhile) would return with the job's memory not
on its GPUs. So the grant is written only if what the decision rests on is still as the plan
read it, on every node where the head has memory (its status there, or the agent lists it):

* the head's status on that node (its mod revision): where its memory is;
* that node's agent key (its mod revision): what is resident there and how much is free.

If any changed, the transaction writes nothing (the leader guard and the head's token still
hold, so its caller sees ``succeeded=False``); the mirror catches up and the next plan decides
again. At most ``MAX_FENCED_NODES`` nodes are compared (etcd bounds a transaction's operations).
"""
from __future__ import annotations

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.keys import Keys
from timeslice.lockd.index import StateIndex

MAX_FENCED_NODES = 32        # 2 compares each; etcd's --max-txn-ops is 128 by default


def planned_on(index: StateIndex, keys: Keys, group: str, job: str) -> list[rpc.Compare]:
    """The compares that hold while the mirror's picture of ``job``'s memory on ``group``'s nodes does."""
    gs = index.groups.get(group)
    nodes = gs.parsed.node_names() if gs is not None and gs.parsed is not None else []
    out: list[rpc.Compare] = []
    fenced = 0
    for node in nodes:
        ns = index.nodes.get(node)
        status = ns.statuses.get(job) if ns is not None else None
        agent = ns.agent if ns is not None else None
        if status is None and not _lists(agent, job):
            continue                                  # nothing of the job there, as planned
        if fenced >= MAX_FENCED_NODES:
            break
        fenced += 1
        for key, kv in ((keys.status(node, job), status), (keys.agent(node), agent)):
            out.append(ops.mod_rev(key, "==", kv.mod_revision) if kv is not None else ops.create_rev(key, "==", 0))
    return out


def _lists(agent, job: str) -> bool:
    """True if the agent key names ``job`` (resident, with a device context, or unknown)."""
    if agent is None:
        return False
    try:
        v = R.AgentValue.load(agent.value)
    except Exception:  # an unreadable agent key names nobody
        return False
    return job in v.job_device_bytes or job in v.job_gpus or job in v.job_unknown
