"""A GRPO-style RL job, time-sliced with the decorator: sampler and trainer phases on the GPU.

    TIMESLICE_TARGET=... TIMESLICE_JOB_ID=job-a python examples/grpo/grpo_job.py --group rl-gpus

The loop is the plain sequential loop an RL trainer already has — generate
rollouts (sampler), score them on the CPU (rewards), take a training step
(trainer) — with the two GPU phases decorated. Between them the job holds
nothing, so another job's context can be restored onto the GPU meanwhile; the
node agent parks this job's memory in host RAM and brings it back bit-exact.

The "GPU" here is the SIMULATED device of ``timeslice.common.sim`` (real bytes in a
bounded shared-memory arena, capacity enforced), so the example runs in CI; on
a real GPU the same loop holds torch tensors instead. The sampler and the
trainer share the job's GPUs, so both phases use one group; with separate GPU
sets, give each its own group. The job prints one JSON line at the end;
``--events FILE`` also writes one JSON line per GPU phase (its times and grant).

SIGTERM (Slurm's ``scancel``, a time limit, a pod's deletion) ends the job
cleanly: the session closes, so its place in the queue and its registered
workers go at once instead of when the session's lease runs out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
import zlib

from timeslice import OrchestratorClient
from timeslice.sim.runtime import SimDeviceClient


class Policy:
    """The job's weights on the (simulated) device; every step rewrites and re-hashes them."""

    def __init__(self, dev: SimDeviceClient, nbytes: int, seed: int):
        self.dev, self.nbytes, self.seed = dev, nbytes, seed
        self.digest = ""

    def load(self) -> None:
        self.dev.alloc(self.nbytes)                   # device memory, taken while holding the group
        with self.dev.compute() as mem:
            mem[:] = random.Random(self.seed).randbytes(self.nbytes)
            self.digest = hashlib.sha256(mem).hexdigest()

    def step(self, salt: int) -> None:
        with self.dev.compute() as mem:               # a "kernel": touch device memory only in here
            assert hashlib.sha256(mem).hexdigest() == self.digest, "device memory changed under the job"
            mem[salt % self.nbytes] = (mem[salt % self.nbytes] + 1) % 256
            self.digest = hashlib.sha256(mem).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="rl-gpus", help="the group of GPUs the job's phases hold (default: %(default)s)")
    ap.add_argument("--node", default=os.environ.get("TIMESLICE_NODE_NAME"), help="this node (default: $TIMESLICE_NODE_NAME)")
    ap.add_argument("--sim-dir", default=os.environ.get("TIMESLICE_SIM_DIR"), help="the simulated device")
    ap.add_argument("--bytes", type=int, default=40 << 20, help="the policy's device memory (default: %(default)s)")
    ap.add_argument("--iterations", type=int, default=3, help="default: %(default)s")
    ap.add_argument("--phase-s", type=float, default=0.1, help="length of each phase, s (default: %(default)s)")
    ap.add_argument("--events", default=None, help="append one JSON line per GPU phase to this file")
    a = ap.parse_args()
    # SystemExit unwinds the `with orchestrator:` below: a blocked acquire gives up its place,
    # a held group is yielded and the session closed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    events = open(a.events, "a", buffering=1) if a.events else None  # noqa: SIM115 - open for the whole run

    def record(phase: str, it: int, t_start: float) -> None:
        if events is not None:
            g = grants[-1]
            events.write(json.dumps({"job": orchestrator.job_id, "phase": phase, "iter": it, "gpu": True,
                                     "t_start": t_start, "t_end": time.time(), "token": g.token,
                                     "restored": g.restored, "elided": g.elided, "bytes_moved": g.bytes_moved,
                                     "waited_ms": g.waited_ms}) + "\n")

    grants = []                                       # what each hold cost: restored? bytes moved?
    orchestrator = OrchestratorClient(after_acquire=grants.append)   # target, job id: TIMESLICE_TARGET/_JOB_ID
    policy = Policy(SimDeviceClient.open(a.sim_dir), a.bytes, seed=zlib.crc32(orchestrator.job_id.encode()))

    @orchestrator.on_accelerators(group_id=a.group, device_bytes_hint=a.bytes)
    def generate(it: int) -> list[int]:               # the sampler's phase
        t_start = time.time()
        if not policy.digest:
            policy.load()
            orchestrator.register_worker(pid=os.getpid(), node=a.node, device_bytes=a.bytes)
            wait_until_reported(orchestrator, a.group, a.node, policy)
        t_end = time.monotonic() + a.phase_s
        n = 0
        while time.monotonic() < t_end:
            policy.step(it * 1000 + n)
            n += 1
        record("generate", it, t_start)
        return [n]

    def rewards(rollouts: list[int]) -> float:        # on the CPU: the GPU is free for others
        time.sleep(a.phase_s)
        return float(sum(rollouts))

    @orchestrator.on_accelerators(group_id=a.group, device_bytes_hint=a.bytes)
    def train(it: int, reward: float) -> None:        # the trainer's phase
        t_start, t_end = time.time(), time.monotonic() + a.phase_s
        while time.monotonic() < t_end:
            policy.step(int(reward) + it)
        record("train", it, t_start)

    with orchestrator:
        for it in range(a.iterations):
            train(it, rewards(generate(it)))
        with orchestrator.on_accelerators(group_id=a.group):
            policy.step(0)                            # a last check of every byte, then free the device
            policy.dev.free()
            orchestrator.unregister_worker(pid=os.getpid(), node=a.node)
    print(json.dumps({"job": orchestrator.job_id, "iterations": a.iterations, "digest_ok": True,
                      "holds": len(grants), "restored": sum(g.restored for g in grants),
                      "elided": sum(g.elided for g in grants)}), flush=True)
    return 0


def wait_until_reported(client: OrchestratorClient, group: str, node: str, policy: Policy,
                        timeout: float = 5.0) -> None:
    """Wait until the node agent's report counts the bytes just allocated (lockd plans from it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status(group)
        mine = [n for n in st.node_status if n.node == node and n.agent_alive]
        if mine and mine[0].device_free_bytes <= policy.dev.dev.free():
            return
        time.sleep(0.02)


if __name__ == "__main__":
    raise SystemExit(main())
