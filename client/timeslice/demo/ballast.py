"""Ballast for the GPU demo's swapping run: ``python -m timeslice.demo.ballast --job-bytes N``.

A real GPU has far more memory than two demo jobs use, so their contexts
would always fit side by side and every swap would be elided. This process
takes most of the GPU's free memory and leaves room for one job only (1.5
times a job's footprint: its bytes plus a CUDA context, which it measures
from its own context), so that every handoff really snapshots one job to host
memory and restores the other. It is not a worker of any job: the node agent
never snapshots it, and lockd sees its memory as used, as it would any other
tenant's. It prints ``READY <ballast bytes> <room bytes>`` and holds the memory
until its stdin closes.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-bytes", type=int, required=True)
    a = ap.parse_args(argv)
    import torch
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = max(0, total - free)          # the GPU is otherwise empty here: this is our context
    room = int(1.5 * (a.job_bytes + context))
    n = max(0, free - room)
    hold = torch.empty(n, dtype=torch.uint8, device="cuda") if n else None
    torch.cuda.synchronize()
    sys.stdout.write(f"READY {n} {room}\n")
    sys.stdout.flush()
    sys.stdin.read()
    del hold
    return 0


if __name__ == "__main__":
    sys.exit(main())
