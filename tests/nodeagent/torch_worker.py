"""A PyTorch worker holding known tensors on a real GPU, for the GPU test and the benchmark.

    python torch_worker.py --bytes N --seed S [--device 0] [--busy]

Fills N bytes of device memory with a seeded pattern, prints
``READY <pid> <checksum> <bytes>``, then answers one command per line:

    verify        -> VERIFY OK|BAD <checksum>   recomputed on the GPU
    hold <ms>     -> HOLDING once a kernel of about <ms> ms is queued, HELD when it finished
    grab <bytes>  -> GRABBED <bytes>            allocate more (to fill the GPU)
    release       -> RELEASED                   drop the grabbed memory and the allocator cache
    quit          -> BYE

The checksum is exact and position-sensitive (a weighted int64 sum per chunk,
folded into one number), computed chunk by chunk so its scratch memory stays
small next to N. The allocator cache is emptied after each command, so the
process holds what it uses, which is what a checkpoint then moves.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

CHUNK = 64 << 20  # int32 elements per checksum chunk (256 MiB)
MASK = (1 << 64) - 1


def checksum(t: torch.Tensor) -> int:
    weights = torch.arange(1, CHUNK + 1, dtype=torch.int64, device=t.device)
    total = 0
    for i, start in enumerate(range(0, t.numel(), CHUNK)):
        c = t[start:start + CHUNK].to(torch.int64)
        s = int((c * weights[: c.numel()]).sum().item())
        total = (total * 1000003 + s + i) & MASK
        del c
    del weights
    torch.cuda.synchronize(t.device)
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--busy", action="store_true", help="keep launching small kernels in the background")
    a = ap.parse_args()
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    data = torch.randint(-2**31, 2**31 - 1, (a.bytes // 4,), dtype=torch.int32, device=dev, generator=gen)
    expected = checksum(data)
    torch.cuda.empty_cache()
    grabbed: list[torch.Tensor] = []
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            print(line, flush=True)

    if a.busy:
        def spin() -> None:
            x = torch.ones(1 << 20, device=dev)
            while True:
                x.mul_(1.0)
                torch.cuda.synchronize(dev)
                time.sleep(0.005)
        threading.Thread(target=spin, daemon=True).start()

    say(f"READY {os.getpid()} {expected} {a.bytes}")
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "verify":
            got = checksum(data)
            torch.cuda.empty_cache()
            say(f"VERIFY {'OK' if got == expected else 'BAD'} {got}")
        elif cmd == "hold":
            # One long kernel: the lock must wait for queued work (Backend.lock).
            torch.cuda._sleep(int(float(args[0]) * 2_000_000))  # ~2 GHz: cycles per ms
            say("HOLDING")
            torch.cuda.synchronize(dev)
            say("HELD")
        elif cmd == "grab":
            grabbed.append(torch.empty(int(args[0]), dtype=torch.uint8, device=dev))
            say(f"GRABBED {args[0]}")
        elif cmd == "release":
            grabbed.clear()
            torch.cuda.empty_cache()
            say("RELEASED")
        elif cmd == "quit":
            break
    say("BYE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
