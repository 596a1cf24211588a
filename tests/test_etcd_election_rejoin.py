"""A standby whose session is lost while it waits its turn (paused past its lease)
leaves the campaign at once instead of waiting for its predecessor."""
import asyncio

import pytest

from timeslice.common.errors import SessionLost
from timeslice.common.server.etcd import Election, EtcdClient, EtcdConfig, Session, SessionTiming


@pytest.fixture
async def client(etcd):
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    yield c
    await c.close()


async def test_standby_that_lost_its_session_leaves_the_campaign(client, etcd, key_prefix):
    prefix = (key_prefix + "election/").encode()
    leader_s = await Session(client, SessionTiming(ttl=5, keepalive_interval=0.5)).open()
    standby_s = await Session(client, SessionTiming(ttl=5, keepalive_interval=0.3)).open()
    try:
        lead = await Election(leader_s, prefix, b"a").campaign()
        standby = asyncio.ensure_future(Election(standby_s, prefix, b"b").campaign())
        await asyncio.sleep(0.3)
        assert not standby.done()                   # waiting behind the leader
        etcd.revoke_lease(standby_s.lease_id)       # as an expiry during a pause would
        with pytest.raises(SessionLost):
            # The leader keeps leading (its key stays): only the lost session can end this wait.
            await asyncio.wait_for(standby, 10)
        # Starting over with a new session it becomes a candidate again, behind the leader.
        again_s = await Session(client, SessionTiming(ttl=5, keepalive_interval=0.3)).open()
        again = asyncio.ensure_future(Election(again_s, prefix, b"b2").campaign())
        await asyncio.sleep(0.3)
        kvs = (await Election(leader_s, prefix).queue.entries())[1]
        assert [kv.value for kv in kvs] == [b"a", b"b2"] and lead.epoch == kvs[0].create_revision
        await leader_s.close()                      # the leader leaves: the rejoined standby leads
        assert (await asyncio.wait_for(again, 10)).epoch > lead.epoch
        await again_s.close()
    finally:
        for s in (leader_s, standby_s):
            if s.alive:
                await s.close()
