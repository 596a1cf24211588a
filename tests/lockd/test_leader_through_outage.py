"""The lockd leader through an etcd majority loss: it takes its lease up again when etcd is back.

While etcd has no majority no renewal gets through, and a leader steps down once its renew
deadline has passed (it cannot write anyway). But etcd keeps every lease while it has no raft
leader and gives each one its whole TTL again when a leader is elected, so the stepped-down
leader's election key is still there, at the head of the election. Before, the replica then
campaigned with a new lease, behind its own old key, and nobody led (nobody granted) until that
key's lease ran out, a TTL after etcd was back. Now the replica takes its lease up again
(``Session.resume``) and leads on with the same epoch as soon as etcd answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from tests.lockd.conftest import Job, admin
from tests.lockd.test_etcd_outage_status import until_leaderless
from timeslice.common.server import records as R
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing.lockd import LockdCluster

DEFAULTS: list[str] = []          # lockd's own timings (lease 3 s, renew deadline 2 s, retry 0.5 s)


async def test_the_leader_leads_on_with_its_epoch_after_an_etcd_majority_loss(etcd3, key_prefix, tmp_path):
    cluster = LockdCluster(etcd3.endpoints_str, key_prefix, n=3, logdir=str(tmp_path), extra=DEFAULTS).start()
    leader, epoch = await asyncio.to_thread(cluster.leader, etcd3)
    target = leader.target
    ch, stub = await admin(target)
    keys = Keys(key_prefix)
    try:
        await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
        a = await Job(target, "A", ttl=60).open()
        raft_leader = await asyncio.to_thread(etcd3.leader)
        survivor = next(m for m in etcd3.members if m is not raft_leader)
        down = [m for m in etcd3.members if m is not survivor]
        for m in down:
            await asyncio.to_thread(m.kill)
        await until_leaderless(survivor)
        # Past the renew deadline: the leader has stepped down (it could not renew its lease).
        await asyncio.to_thread(leader.wait_events, "stopped_leading", 1, 30, epoch=epoch)
        for m in down:
            await asyncio.to_thread(m.restart)
        await etcd3.wait_healthy_async(30)
        healed = time.monotonic()
        # A free group: only the leader's scheduler grants it (no Yield to hand it over in).
        got = await a.acquire("g", timeout=60)
        print(f"\n  first grant {time.monotonic() - healed:.2f} s after etcd's majority was back")
        r = await a.stub.GetGroupStatus(pb.GroupRef(group_id="g"), timeout=10)
        assert r.grant.token == got.token
        # Granted by the same leader, with its epoch: it took its lease up again.
        async with etcd_client_for(etcd3) as c:
            kv = (await c.range(ops.range_req(keys.grant("g")))).kvs[0]
        assert R.GrantValue.load(kv.value).leader_epoch == epoch, "a new leader (a new epoch) granted it"
        assert leader.events("lease_taken_up"), "the lapsed lease was not taken up again"
        await a.close()
    finally:
        await ch.close()
        cluster.stop()


@contextlib.asynccontextmanager
async def etcd_client_for(etcd3):
    c = EtcdClient(EtcdConfig.parse(etcd3.endpoints_str))
    try:
        yield c
    finally:
        await c.close()
