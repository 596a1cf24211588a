"""A grant planned on a stale mirror is not written (lockd/grantfence.py), against a real etcd.

A leader plans on its mirror. A mirror can lag etcd (a replica whose etcd member stalls keeps
its watch there for seconds; a new leader plans at once on what its mirror had): here it shows
job K running and resident on node n1 while etcd already says K was snapshotted (another
leader's intent, answered meanwhile). The plan then is a plain grant to K; written, it would
return K's Acquire with its memory checkpointed. The scheduler's grant compares what it was
planned on, so nothing is written until the mirror has caught up, and then the plan restores K.
"""
from __future__ import annotations

import hashlib

from timeslice.common.server import records as R
from timeslice.common.server.etcd import Election, EtcdClient, EtcdConfig, Reflector, Session, SessionTiming, ops
from timeslice.common.server.keys import Keys
from timeslice.lockd import plan as P
from timeslice.lockd.index import StateIndex
from timeslice.lockd.metrics import LockdMetrics
from timeslice.lockd.scheduler import Scheduler

MiB = 1 << 20
NODE = "n1"


def _agent(resident: dict[str, int]) -> bytes:
    used = sum(resident.values())
    return R.AgentValue(NODE, "sim", gpus=[{"index": 0, "uuid": "sim0", "total_bytes": 8 * MiB,
                                            "free_bytes": 8 * MiB - used}],
                        device_total_bytes=8 * MiB, device_free_bytes=8 * MiB - used, host_free_bytes=1 << 30,
                        job_device_bytes=dict(resident), updated_ms=R.now_ms(),
                        job_gpus={j: {"sim0": n} for j, n in resident.items()}).dump()


def _status(state: str) -> bytes:
    return R.StatusValue(state, "K", op=R.SNAPSHOT if state == R.SNAPSHOTTED else "", outcome=R.OK, group="g",
                         token=1, device_bytes=4 * MiB, pids=[4242], gpu_bytes={"sim0": 4 * MiB}).dump()


async def test_a_grant_planned_on_a_stale_mirror_is_not_written_and_the_job_is_restored_first(etcd, key_prefix):
    client = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    keys = Keys(key_prefix)
    session = await Session(client, SessionTiming(ttl=10)).open()
    reflector = None
    try:
        lease = session.lease_id
        await client.txn([], [
            ops.put(keys.spec("g"), R.GroupSpec(nodes=[{"node": NODE}]).dump()),
            ops.put(keys.session("K"), R.SessionValue(lease, hashlib.sha256(b"s").hexdigest()).dump(), lease),
            ops.put(keys.agent(NODE), _agent({"K": 4 * MiB}), lease),
            ops.put(keys.status(NODE, "K"), _status(R.RUNNING)),
            ops.put(keys.worker("K", NODE, 4242), R.WorkerValue(4242, NODE, 4 * MiB, R.now_ms()).dump(), lease),
            ops.put(keys.queue_entry("g", "K"), R.QueueValue("K", lease, 4 * MiB).dump(), lease)])
        lead = await Election(session, keys.election()).campaign()
        index = StateIndex(keys)
        reflector = Reflector(client, keys.root())
        reflector.add_listener(lambda events, reset: index.rebuild(reflector.kvs) if reset else index.apply(events))
        reflector.start()
        await reflector.synced.wait()
        gs = index.groups["g"]
        planned = P.plan_group(gs, index.nodes, index.jobs, R.now_ms(), P.Policy(), index.node_jobs,
                               index.specs_held_by)
        assert [type(a) for a in planned] == [P.WriteGrant], planned       # K running there: a plain grant

        # The mirror stops here; etcd moves on: K was snapshotted (its status, the agent's key).
        await reflector.stop()
        await client.txn([], [ops.put(keys.status(NODE, "K"), _status(R.SNAPSHOTTED)),
                              ops.put(keys.agent(NODE), _agent({}), lease)])
        sched = Scheduler(lead, keys, index, reflector, P.Policy(), LockdMetrics())
        sched._dirty.add("g")
        await sched._work("g")                  # plans on the stale mirror (and waits for it, in vain)
        assert not (await client.range(ops.range_req(keys.grant("g")))).kvs, \
            "granted on a stale mirror: K's Acquire would return with its memory checkpointed"

        # Once the mirror has caught up, the plan restores K before anything is granted.
        reflector = Reflector(client, keys.root())
        reflector.add_listener(lambda events, reset: index.rebuild(reflector.kvs) if reset else index.apply(events))
        reflector.start()
        await reflector.synced.wait()
        sched = Scheduler(lead, keys, index, reflector, P.Policy(), LockdMetrics())
        sched._dirty.add("g")
        await sched._work("g")
        intent = (await client.range(ops.range_req(keys.intent(NODE, "K")))).kvs
        assert intent and R.IntentValue.load(intent[0].value).op == R.RESTORE
        assert not (await client.range(ops.range_req(keys.grant("g")))).kvs
    finally:
        if reflector is not None:
            await reflector.stop()
        await session.close()
        await client.close()
