"""An election candidate in its own process.

argv: endpoints election_prefix name out_file ttl
Campaigns; once leading, every 0.1 s tries a leader-guarded write of
<election_prefix without slash>-data = "<name>:<i>" and logs each attempt as a JSON line:
{"name", "event": "leading"|"write", "epoch", "ok", "revision", "t"}.
"""
import asyncio
import json
import sys
import time

from timeslice.common.errors import NotLeader, TimesliceError
from timeslice.common.server.etcd import Election, EtcdClient, EtcdConfig, Session, SessionTiming, ops


def log(out, **rec):
    rec["t"] = time.monotonic()
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


async def main(endpoints, prefix, name, out, ttl):
    client = EtcdClient(EtcdConfig.parse(endpoints))
    session = await Session(client, SessionTiming(ttl=int(ttl))).open()
    lead = await Election(session, prefix.encode()).campaign()
    log(out, name=name, event="leading", epoch=lead.epoch)
    data_key = prefix.rstrip("/").encode() + b"-data"   # outside the election prefix
    i = 0
    while True:
        i += 1
        try:
            # Not lead.txn(): it checks the session first, and a paused process
            # must really send the write to prove etcd refuses it.
            resp = await client.txn([lead.guard()], [ops.put(data_key, f"{name}:{i}".encode())])
            log(out, name=name, event="write", epoch=lead.epoch, ok=resp.succeeded,
                revision=resp.header.revision)
        except (NotLeader, TimesliceError) as e:
            log(out, name=name, event="write", epoch=lead.epoch, ok=False, error=str(e))
        await asyncio.sleep(0.1)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
