"""lockd's and the agents' etcd client rides through a member that stops answering:
reads are re-sent in short attempts, and the HTTP/2 keepalive
closes the dead connection so that the channel moves to another member."""
import asyncio

from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops


async def test_read_rides_through_a_paused_member(etcd3, key_prefix):
    first = etcd3.members[0]                 # gRPC's pick_first connects to the first endpoint
    c = EtcdClient(EtcdConfig.parse(etcd3.endpoints_str, timeout=30))
    key = (key_prefix + "k").encode()
    try:
        await c.txn([], [ops.put(key, b"v")])
        await asyncio.to_thread(first.pause)
        try:
            r = await c.range(ops.range_req(key), timeout=25)
        finally:
            await asyncio.to_thread(first.resume)
        assert r.kvs and r.kvs[0].value == b"v"
    finally:
        await c.close()
