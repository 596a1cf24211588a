"""Ballast for the GPU demo's swapping run: ``python -m timeslice.launcher.demo.ballast --job-bytes N``.

A real GPU has far more memory than two demo jobs use, so their contexts
would always fit side by side and every swap would be elided. This process
takes most of the GPU's free memory and leaves room for one job only, so that
every handoff really snapshots one job to host memory and restores the other.
A job's footprint is its bytes plus its CUDA context, about 1.5 times the
ballast's own bare context (measured on an H200: a 1.07 GB job checkpointed
as 1.85 GB). The room is 1.75 footprints: less than two jobs, and enough for
one job beside the context of a job that is exiting, plus the node agent's
restore headroom. It is not a worker of any job: the node agent
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
    footprint = a.job_bytes + 1.5 * context
    room = int(1.75 * footprint)
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
