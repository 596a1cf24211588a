"""One job of the placement benchmark: ``python -m benchmarks.placement_job ...`` (SIMULATED device).

An RL-shaped loop with jittered phases: acquire the group, hold it for a GPU
phase (its bytes on the simulated GPU are touched inside it), yield, then a CPU
phase (sleep), until ``--until`` (unix time). The first hold allocates the
job's device memory and registers the worker, so the node agent can swap it.
Each hold is written to ``--events`` as one JSON line: ``{"t_start", "t_end"}``
(wall clock, from the grant's return to the yield's call) — the job's GPU
phase as the demo's analysis counts it.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--sim-dir", required=True)
    ap.add_argument("--gpu", type=int, default=0, help="the simulated GPU of the group")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--hold-ms", type=float, required=True)
    ap.add_argument("--gap-ms", type=float, required=True)
    ap.add_argument("--jitter", type=float, default=0.0, help="each phase is uniform in (1 +- jitter) x its mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-at", type=float, default=0.0, help="unix time of the first acquire")
    ap.add_argument("--until", type=float, default=0.0, help="unix time after which no new phase starts")
    ap.add_argument("--start-file", default="",
                    help="instead of --start-at/--until: write <file>.ready.<job> once connected, then wait "
                         "for <file> to say '<start> <until>' (every job of a run starts together, however "
                         "long its imports took)")
    ap.add_argument("--events", required=True)
    a = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # the benchmark asks a stuck job where it is

    from timeslice import OrchestratorClient
    from timeslice.common.server import logs
    from timeslice.sim.runtime import SimDeviceClient
    logs.configure("placement-job", "warning", json=False, stream=sys.stderr)
    rnd = random.Random(a.seed)

    def draw(ms: float) -> float:
        return max(0.0, ms * (1 + rnd.uniform(-a.jitter, a.jitter))) / 1000

    dev = SimDeviceClient.open(a.sim_dir, gpu=a.gpu)
    holds = []
    with OrchestratorClient(a.target, job_id=a.job_id, timeout=60) as c, open(a.events, "w") as out:
        # Its peak and context, measured at each yield as a real job's framework reports them: with
        # none observed, lockd would plan every hold as a first one (room to spare), not as advise does.
        c.memory_stats = dev
        if a.start_file:
            a.start_at, a.until = _wait_start(a.start_file, a.job_id)
        time.sleep(max(0.0, a.start_at - time.time()))
        first = True
        last = False
        while not last:
            c.acquire(a.group, timeout=120, device_bytes_hint=a.bytes)
            t0 = time.time()
            if first:
                dev.alloc(a.bytes)
                c.register_worker(pid=os.getpid(), node=a.node, device_bytes=a.bytes)
                _wait_reported(c, a, dev)
                first = False
            with dev.compute() as mem:                  # a kernel: the bytes are there while holding
                mem[0] = (mem[0] + 1) % 256
            time.sleep(max(0.0, draw(a.hold_ms) - (time.time() - t0)))
            t1 = time.time()
            last = t1 >= a.until
            if last:
                # Free while holding: once yielded, the agent may park us and the device calls
                # of a free would wait for a restore that never comes.
                dev.free()
                c.unregister_worker(pid=os.getpid(), node=a.node)
            c.yield_(a.group)
            holds.append((t0, t1))
            out.write(json.dumps({"job": a.job_id, "t_start": t0, "t_end": t1}) + "\n")
            if not last:
                time.sleep(draw(a.gap_ms))
    print(json.dumps({"job": a.job_id, "holds": len(holds)}), flush=True)
    return 0


def _wait_start(path: str, job: str, timeout: float = 300.0) -> tuple[float, float]:
    open(f"{path}.ready.{job}", "w").close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            start, until = open(path).read().split()
            return float(start), float(until)
        except (OSError, ValueError):
            time.sleep(0.05)
    raise TimeoutError(f"no start time in {path} after {timeout} s")


def _wait_reported(c, a, dev, timeout: float = 5.0) -> None:
    """Until the agent's report of free device memory counts our new bytes: lockd decides
    from it whether the next job fits beside us (see the demo job for the same wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status(a.group)
        mine = [n for n in st.node_status if n.node == a.node and n.agent_alive]
        if mine and mine[0].device_free_bytes <= dev.dev.free():
            return
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
