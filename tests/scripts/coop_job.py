"""A cooperative job in its own process, on the SIMULATED device: the public client + SimCooperativeMemory.

argv: target job_id node sim_dir socket regions   (regions: "weights:4194304:offload,kv:2097152:discard")
Then one command per line on stdin, one JSON line per answer on stdout:

    acquire <group> [hint]   -> {"ok", "token", "restored", "bytes_moved", "elided"} or {"ok": false, "error"}
    yield <group>            -> {"ok", "deferred"}
    verify <tag>             -> {"ok", "match"}  the region's checksum against what it must be (inside a hold!)
    write <tag> <hex>        -> {"ok"}           change the region's first bytes (inside a hold)
    touch <tag>              -> {"ok": false, "error"} for a released region (a stray call outside a hold)
    swaps                    -> {"ok", "swaps", "paused", "host_bytes", "backup", "reservations"}
    cooperate                -> {"ok", "host_bytes", "reservations"}  before any hold: the channel, the
                                registration and the pinned pool (the regions go on the device at the
                                first grant); blocks while $TIMESLICE_SIM_PIN_GATE is closed
    clean <tag> / dirty <tag> -> {"ok"}          mark_clean / mark_dirty
    scratch <bytes> [n]      -> {"ok", "room_asks"}  a temporary of that size on the device, inside a hold
                                (n times); one that does not fit asks the agent for room and retries
    measured <group>         -> {"ok", "peak", "context"}  what the next Acquire will say of the holds
    channel hold [seconds]   -> {"ok"}  the worker does not reconnect to its agent for that long
                                        (default: until "channel release"); an open channel stays open
    channel release          -> {"ok"}  it reconnects again (within its backoff, at most ~3 s)
    close                    -> {"ok"}  the client closes (channel, then session); the process lives on
    quit                     -> {"ok"} and exit 0
It prints {"ready": pid} at start. Without ``cooperate``, like a job whose sizes are known only once
its model is loaded, it puts its memory on the device inside its first hold and registers then.
The regions' copies run at $TIMESLICE_SIM_COOP_GBPS (unset: unthrottled); $COOP_JOB_CONTEXT_BYTES sizes
the memory's own context arena (default SimCooperativeMemory's).
"""
import json
import os
import sys
import time

from timeslice import OrchestratorClient
from timeslice.common.channel import ChannelError
from timeslice.sim.coop import SimCooperativeMemory


def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def main(target, job, node, sim_dir, sock, regions):
    spec = {}
    for part in regions.split(","):
        tag, n, pol = part.split(":")
        spec[tag] = (int(n), pol)
    client = OrchestratorClient(target=target, job_id=job)
    mem = worker = None
    held_until = [0.0]                       # "channel hold": no reconnect before this (monotonic)
    gbps = float(os.environ["TIMESLICE_SIM_COOP_GBPS"]) if os.environ.get("TIMESLICE_SIM_COOP_GBPS") else 0
    ctx = {"context_bytes": int(os.environ["COOP_JOB_CONTEXT_BYTES"])} if os.environ.get("COOP_JOB_CONTEXT_BYTES") else {}

    def held_connect(connect):
        def attempt():
            if time.monotonic() < held_until[0]:
                raise ChannelError("the test holds this worker's reconnection")
            return connect()
        return attempt
    say(ready=__import__("os").getpid())
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "acquire":
                g = client.acquire(args[0], timeout=60, device_bytes_hint=int(args[1]) if len(args) > 1 else 0)
                if mem is None:
                    mem = SimCooperativeMemory(spec, sim_dir, seed=sum(map(ord, job)), gbps=gbps, **ctx)
                    worker = client.cooperate(mem, node=node, socket_path=sock)
                    worker.connect = held_connect(worker.connect)
                elif not mem.allocated():
                    mem.allocate()                     # the model goes on the device in the first hold
                say(ok=True, token=g.token, restored=g.restored, bytes_moved=g.bytes_moved, elided=g.elided,
                    at=time.monotonic())
            elif cmd == "cooperate":
                mem = SimCooperativeMemory(spec, sim_dir, seed=sum(map(ord, job)), gbps=gbps, resident=False, **ctx)
                worker = client.cooperate(mem, node=node, socket_path=sock)
                worker.connect = held_connect(worker.connect)
                say(ok=True, host_bytes=mem.host_bytes(), reservations=mem.host_pool.reservations,
                    at=time.monotonic())
            elif cmd == "scratch":
                for _ in range(int(args[1]) if len(args) > 1 else 1):
                    with mem.scratch(int(args[0])) as buf:
                        buf[:8] = b"scratch!"             # real bytes, written inside the hold
                say(ok=True, room_asks=mem.room_asks)
            elif cmd == "measured":
                m = client.measured(args[0])
                say(ok=True, peak=m.peak_bytes, context=m.context_bytes)
            elif cmd == "clean":
                mem.mark_clean(args[0])
                say(ok=True)
            elif cmd == "dirty":
                mem.mark_dirty(args[0])
                say(ok=True)
            elif cmd == "yield":
                r = client.yield_(args[0])
                say(ok=True, deferred=bool(getattr(r, "deferred_snapshot", False)))
            elif cmd == "verify":
                say(ok=True, match=mem.checksum(args[0], timeout_s=30) == mem.expected(args[0]))
            elif cmd == "write":
                mem.write(args[0], bytes.fromhex(args[1]))
                say(ok=True)
            elif cmd == "touch":
                mem.checksum(args[0], timeout_s=float(args[1]) if len(args) > 1 else 2.0)
                say(ok=True)
            elif cmd == "swaps":
                say(ok=True, swaps=worker.swaps, paused=worker.paused, host_bytes=mem.host_bytes(),
                    backup=mem.backup_stats(), reservations=mem.host_pool.reservations)
            elif cmd == "channel":
                held_until[0] = (0.0 if args[0] == "release" else
                                 time.monotonic() + (float(args[1]) if len(args) > 1 else 1e9))
                say(ok=True)
            elif cmd == "close":
                client.close()
                say(ok=True)
            elif cmd == "quit":
                say(ok=True)
                break
        except Exception as e:
            say(ok=False, error=f"{type(e).__name__}: {e}")
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:7])
