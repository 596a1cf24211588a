"""A SIMULATED-GPU worker process, for tests and the demo: ``python -m timeslice.sim.worker``.

It does what an RL worker does to its GPU, on the simulated device: allocates
an arena, fills it with a seeded pattern, and keeps computing on it in a
background thread (reading the bytes, as kernels would) until told to stop.
Commands arrive one per line on stdin; answers go to stdout, one line each:

    checksum      -> CHECKSUM <sha256>   (a device operation: blocks while checkpointed)
    verify        -> VERIFY OK|BAD <sha256>  against the checksum at fill time
    hold <ms>     -> HOLDING, then HELD after keeping the device busy <ms> ms
    steps         -> STEPS <n>           compute steps done so far
    free          -> FREED               stop computing, release the device memory (a device
                                         operation: blocks while locked or checkpointed, as a CUDA
                                         process's teardown does)
    quit          -> BYE, and exit 0

At start it prints ``READY <pid> <sha256>``.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
import threading
import time
import zlib

from timeslice.sim.runtime import SimDeviceClient


def pattern(seed: int, nbytes: int) -> bytes:
    """The seeded fill: deterministic, so a test can recompute what the worker holds."""
    return random.Random(seed).randbytes(nbytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-dir", default=None)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", type=int, default=None,
                    help="simulated GPU to bind to (default: $TIMESLICE_SIM_GPU, else 0)")
    ap.add_argument("--step-ms", type=float, default=1.0, help="pause between compute steps")
    a = ap.parse_args(argv)

    dev = SimDeviceClient.open(a.sim_dir, a.gpu)
    dev.alloc(a.bytes)
    data = pattern(a.seed, a.bytes)
    with dev.compute() as mem:
        mem[:] = data
    expected = hashlib.sha256(data).hexdigest()
    del data
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    stop = threading.Event()
    steps = 0

    def compute_loop() -> None:
        nonlocal steps
        window = min(a.bytes, 64 << 10)
        off = 0
        while not stop.is_set():
            with dev.compute() as mem:  # a "kernel": read a window of device memory
                zlib.crc32(mem[off:off + window])
            off = (off + window) % max(1, a.bytes - window + 1)
            steps += 1
            time.sleep(a.step_ms / 1000)

    computing = threading.Thread(target=compute_loop, daemon=True)
    computing.start()
    say(f"READY {dev.pid} {expected}")
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "checksum":
            say(f"CHECKSUM {dev.checksum()}")
        elif cmd == "verify":
            got = dev.checksum()
            say(f"VERIFY {'OK' if got == expected else 'BAD'} {got}")
        elif cmd == "hold":
            with dev.compute():
                say("HOLDING")
                time.sleep(float(args[0]) / 1000)
            say("HELD")
        elif cmd == "steps":
            say(f"STEPS {steps}")
        elif cmd == "free":
            stop.set()
            computing.join()
            dev.free()
            say("FREED")
        elif cmd == "quit":
            break
    stop.set()
    say("BYE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
