"""A stand-in for NVIDIA's ``cuda-checkpoint`` tool, over the SIMULATED device.

It follows the tool's documented command line:

    fake_cuda_checkpoint.py --get-state --pid P
    fake_cuda_checkpoint.py --action lock|checkpoint|restore|unlock --pid P [--timeout MS]

and acts on the simulated device in ``$TIMESLICE_SIM_DIR`` (host copies in
``$TIMESLICE_SIM_HOST_DIR``), so a test of the ``cuda-cli`` backend drives real
state changes on real worker processes. On failure it prints the driver's
error name and description to stderr and exits 1, as the tool reports driver
errors; ``--get-state`` prints one word: running, locked, checkpointed, failed.
"""
from __future__ import annotations

import argparse
import sys

import structlog

from timeslice.common import device_errors as e
from timeslice.nodeagent.backends import curesult
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.sim import SimBackend

# What the driver answers, for each simulator error (as measured on an H200: nodeagent/backends/curesult.py).
_CODES = [(e.ProcessGone, 304), (e.NoCudaContext, 3), (e.LockTimeout, 600), (e.IllegalState, 401),
          (e.DeviceOutOfMemory, 2), (e.ContextLost, 304)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cuda-checkpoint")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--get-state", action="store_true")
    what.add_argument("--action", choices=["lock", "checkpoint", "restore", "unlock"])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--timeout", type=int, default=0, help="lock timeout in ms, 0 = none")
    a = ap.parse_args(argv)

    # stdout carries the answer (one state word), as with the real tool: logs go elsewhere.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sim = SimBackend()
    try:
        if a.get_state:
            state = sim.get_state(a.pid)
            if state is ProcState.GONE:
                raise e.ProcessGone("no such process", pid=a.pid)
            if state is ProcState.NO_CUDA:
                raise e.NoCudaContext("no CUDA context", pid=a.pid)
            print(state.value)
        elif a.action == "lock":
            sim.lock(a.pid, a.timeout if a.timeout > 0 else 10 ** 9)
        else:
            getattr(sim, a.action)(a.pid)
    except e.BackendError as exc:
        code = next((c for cls, c in _CODES if isinstance(exc, cls)), 999)
        name, desc = curesult.CU_RESULTS[code]
        what = "get state" if a.get_state else a.action
        print(f"Could not {what} of process {a.pid}: {desc} ({name})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
