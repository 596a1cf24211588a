"""A cooperative worker that speaks the node-local channel by hand, so a test can make it misbehave.

argv: socket job secret sim_dir
It puts a 1 MiB arena on the simulated device, says hello with one region ("w", offload),
answers the agent's pause and resume with ``done`` frames (moving nothing: the agent only
needs the answer), and prints what happens:

    WELCOME <pid>        the agent let it in
    PAUSED | RESUMED     it answered a pause or a resume
    REPLY <json>         any other frame the agent sent (a refusal)
    EOF                  the agent closed the channel

On stdin, one command per line: ``send <hex>`` sends those raw bytes on the channel.
"""
import json
import os
import socket
import sys
import threading

from timeslice.common import channel as C
from timeslice.sim.runtime import SimDeviceClient

MiB = 1 << 20


def say(*words) -> None:
    print(*words, flush=True)


def main(path: str, job: str, secret: str, sim_dir: str) -> None:
    dev = SimDeviceClient.open(sim_dir)
    dev.alloc(MiB)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    C.send(s, {"type": "hello", "version": C.PROTOCOL_VERSION, "job": job, "secret": secret, "device": "sim0",
               "tags": {"w": "offload"}, "region_bytes": {"w": MiB}, "host_bytes": 0, "paused": []})
    welcome = C.recv(s)
    if welcome.get("type") != "welcome":
        say("REPLY", json.dumps(welcome))
        return
    say("WELCOME", welcome["pid"])
    mu = threading.Lock()

    def serve() -> None:
        while True:
            try:
                msg = C.recv(s)
            except (OSError, C.ChannelError):
                say("EOF")
                return
            kind = msg.get("type")
            if kind in ("pause", "resume"):
                paused = ["w"] if kind == "pause" else []
                with mu:
                    C.send(s, {"type": "done", "id": msg["id"], "ok": True, "bytes_moved": MiB, "device_bytes": MiB,
                               "elapsed_ms": 1.0, "tags": ["w"], "state": "paused" if paused else "running",
                               "paused": paused, "host_bytes": MiB, "region_bytes": {"w": MiB}})
                say("PAUSED" if paused else "RESUMED")
            else:
                say("REPLY", json.dumps(msg))

    threading.Thread(target=serve, daemon=True).start()
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "send":
            with mu:
                s.sendall(bytes.fromhex(arg))
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:5])
