"""A checkpoint-backend job in its own process, on the SIMULATED device: the public client + SimDeviceClient.

argv: target job_id node sim_dir nbytes
The process is its own worker, as an RL job's is: with its first grant it allocates ``nbytes`` on the
simulated device, fills them with a seeded pattern and calls ``register_worker`` (which attests the
process over the node agent's channel, as the library does for every job). Then one command per line
on stdin, one JSON line per answer on stdout:

    acquire <group> [hint] -> {"ok", "token", "restored", "bytes_moved", "back", "detail"} where ``back``
                              says, right at the grant and without blocking, whether this process's
                              memory is on the device (running, arena whole); the first grant also
                              allocates: {"alloc": "ok"} or {"alloc": "<why it did not fit>"}
    yield <group>          -> {"ok", "deferred"}
    verify                 -> {"ok", "match"}   the arena's checksum against the fill (a device call:
                                                blocks while checkpointed, at most 10 s)
    quit                   -> {"ok"} and exit 0
It prints {"ready": pid} at start.
"""
import hashlib
import json
import os
import random
import sys
import time

from timeslice import OrchestratorClient
from timeslice.common.sim.device import CHECKPOINTED
from timeslice.sim.runtime import SimDeviceClient


def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def main(target, job, node, sim_dir, nbytes):
    nbytes = int(nbytes)
    client = OrchestratorClient(target=target, job_id=job)
    dev = SimDeviceClient.open(sim_dir)
    expected = ""

    def back() -> tuple[bool, str]:
        doc = dev.dev.read_state(dev.pid)
        state = doc["state"] if doc else "unregistered"
        try:
            size = os.path.getsize(dev.dev.arena(dev.pid))
        except FileNotFoundError:
            size = 0
        return (state not in (CHECKPOINTED, "unregistered") and size >= nbytes,
                f"process {state} on the simulated device, arena {size} of {nbytes} bytes")

    say(ready=os.getpid())
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "acquire":
                g = client.acquire(args[0], timeout=60, device_bytes_hint=int(args[1]) if len(args) > 1 else 0)
                out = {"ok": True, "token": g.token, "restored": g.restored, "bytes_moved": g.bytes_moved,
                       "at": time.monotonic()}
                if not expected:
                    try:
                        dev.alloc(nbytes, timeout_s=10)
                        data = random.Random(sum(map(ord, job))).randbytes(nbytes)
                        with dev.compute(timeout_s=10) as mem:
                            mem[:] = data
                        expected = hashlib.sha256(data).hexdigest()
                        client.register_worker(node=node, device_bytes=nbytes)
                        out["alloc"] = "ok"
                    except Exception as e:
                        out["alloc"] = f"{type(e).__name__}: {e}"
                ok, detail = back()
                say(**out, back=ok, detail=detail)
            elif cmd == "yield":
                r = client.yield_(args[0])
                say(ok=True, deferred=bool(getattr(r, "deferred_snapshot", False)))
            elif cmd == "verify":
                say(ok=True, match=bool(expected) and dev.checksum(timeout_s=10) == expected)
            elif cmd == "quit":
                say(ok=True)
                break
        except Exception as e:
            say(ok=False, error=f"{type(e).__name__}: {e}")
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:6])
