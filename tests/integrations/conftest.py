"""Fixtures for real-framework jobs (TRL, a plain transformers loop) time-sliced on the SIMULATED
device: real etcd, one lockd replica, the node's agent, and job processes from examples/grpo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timeslice.common.sim.device import SimDevice
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdCluster
from timeslice.testing.procs import track, untrack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "grpo"
NODE = "rl-node"


class Jobs:
    """Job processes (examples/grpo/*_job.py) started at once, each writing one JSON document."""

    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp, self.env = tmp, env
        self.n = 0

    def start(self, script: str, job: str, *args: str, standalone: bool = False) -> tuple[subprocess.Popen, Path]:
        self.n += 1
        out = self.tmp / f"{job}-{self.n}.json"
        argv = [sys.executable, str(EXAMPLES / script), "--out", str(out), *args]
        if standalone:
            argv.append("--standalone")
        with open(self.tmp / f"{job}-{self.n}.log", "wb") as log:   # the child keeps its own descriptor
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **self.env, "TIMESLICE_JOB_ID": job})
        track(p)
        return p, out

    def wait(self, started: list[tuple[subprocess.Popen, Path]], timeout: float = 240) -> list[dict]:
        docs = []
        deadline = time.monotonic() + timeout
        for p, out in started:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "timeout"
            untrack(p.pid)
            log = out.with_suffix(".log").read_text()[-4000:] if out.with_suffix(".log").exists() else ""
            assert rc == 0 and out.exists(), f"job {out.name} ended {rc}:\n{log}"
            docs.append(json.loads(out.read_text()))
        return docs

    def run(self, runs: list[tuple], timeout: float = 240) -> list[dict]:
        """Start every (script, job, args, standalone) at once, their loops together (the barrier), wait for all."""
        self.env["TIMESLICE_EXAMPLE_BARRIER"] = f"{self.tmp / f'barrier-{self.n}'}:{len(runs)}"
        return self.wait([self.start(s, j, *args, standalone=alone) for s, j, args, alone in runs], timeout)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """alone(runs) -> the documents of jobs run standalone (no lock, no agent), all at once;
    the same runs asked again in the module are not run again."""
    d = tmp_path_factory.mktemp("alone")
    done: dict[tuple, list[dict]] = {}

    def run(runs: list[tuple]) -> list[dict]:
        key = tuple((s, tuple(args)) for s, _j, args, _a in runs)
        if key not in done:
            done[key] = Jobs(d, {}).run(runs)
        return done[key]
    return run


@pytest.fixture
def rl_stack(etcd, key_prefix, tmp_path):
    """rl_stack(capacity, isolation="", agent_extra=(), backend="sim") -> (Jobs, agent): the SIMULATED device
    resized to ``capacity`` bytes (``backend="cuda-driver"``: the real GPU, capacity unused), its agent, one
    lockd replica and group ``rl-gpus`` (the jobs' default) over the node. Stopped on the way out."""
    made: list = []

    def make(capacity: int, isolation: str = "", agent_extra: tuple[str, ...] = (), backend: str = "sim"):
        sim, host = tmp_path / "sim", tmp_path / "host"
        lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
        made.append(lockd)
        if backend == "sim":
            SimDevice(sim, host, capacity_bytes=capacity)
            agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), sim_dir=sim,
                                 env={"TIMESLICE_SIM_HOST_DIR": str(host)},
                                 extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0", *agent_extra])
        else:
            agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), backend=backend,
                                 extra=list(agent_extra))
        made.append(agent.start())
        from timeslice import OrchestratorClient
        with OrchestratorClient(target=lockd.replicas[0].target, job_id="admin") as admin:
            admin.create_group("rl-gpus", nodes=[NODE], isolation=isolation)
        env = {"TIMESLICE_TARGET": lockd.replicas[0].target, "TIMESLICE_NODE_NAME": NODE,
               "TIMESLICE_AGENT_SOCKET": agent.socket}
        if backend == "sim":
            env.update(TIMESLICE_SIM_DIR=str(sim), TIMESLICE_SIM_HOST_DIR=str(host))
        return Jobs(tmp_path, env), agent

    yield make
    for proc in reversed(made):
        proc.stop()
