"""A lock contender in its own process: join a FifoQueue, wait for its turn, record the hold, leave.

argv: endpoints queue_prefix name out_file [hold_seconds] [ttl]
Writes one JSON line {name, token, start, end} (monotonic clock, comparable across processes).
"""
import asyncio
import json
import sys
import time

from timeslice.common.server.etcd import EtcdClient, EtcdConfig, FifoQueue, Session, SessionTiming


async def main(endpoints, prefix, name, out, hold=0.02, ttl=5):
    client = EtcdClient(EtcdConfig.parse(endpoints))
    async with Session(client, SessionTiming(ttl=int(ttl))) as session:
        queue = FifoQueue(client, prefix.encode())
        held = await queue.wait_turn(await queue.enqueue(name, b"", session.lease_id))
        start = time.monotonic()
        with open(out + ".holding", "w") as f:
            f.write(str(held.token))
        await asyncio.sleep(float(hold))
        end = time.monotonic()
        await queue.remove(held)
    with open(out, "a") as f:
        f.write(json.dumps({"name": name, "token": held.token, "start": start, "end": end}) + "\n")
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
