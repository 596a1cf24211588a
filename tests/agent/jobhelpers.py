"""Jobs for the end-to-end swap tests: a cooperative job in its own process (tests/scripts/coop_job.py,
the public client + SimCooperativeMemory) and a checkpoint job driven through lockd's API from the
test with a SimWorker holding its bytes. Both on the test's SIMULATED device."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from agenthelpers import NODE

from timeslice.proto import lockd_pb2 as lpb

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "scripts", "coop_job.py")
CKPT_SCRIPT = os.path.join(os.path.dirname(HERE), "scripts", "ckpt_job.py")


class Job:
    """A cooperative job process: one command per line in, one JSON answer out (see coop_job.py)."""

    def __init__(self, target: str, job: str, sim_dir, sock: str, regions: str, env: dict | None = None):
        self.job = job
        self.p = subprocess.Popen([sys.executable, SCRIPT, target, job, NODE, str(sim_dir), sock, regions],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env={**os.environ, "TIMESLICE_NODE_NAME": NODE, **(env or {})})
        self.pid = self._read(60)["ready"]

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"job process exited ({self.p.poll()})")
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError("no answer from the job process")

    def send(self, cmd: str) -> None:
        """Send a command without waiting for its answer (read it later with ``_read``)."""
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def __call__(self, cmd: str, timeout: float = 90) -> dict:
        self.send(cmd)
        return self._read(timeout)

    async def ask(self, cmd: str, timeout: float = 90) -> dict:
        """The same, off the event loop (an acquire that waits while the test does other things)."""
        return await asyncio.to_thread(self, cmd, timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)


class CkptProc(Job):
    """A checkpoint job in its own process through the public client (see ckpt_job.py): its process is
    its worker and attests itself over the agent's channel when it registers, as every job's does."""

    def __init__(self, target: str, job: str, sim_dir, nbytes: int, env: dict | None = None):
        self.job = job
        self.p = subprocess.Popen([sys.executable, CKPT_SCRIPT, target, job, NODE, str(sim_dir), str(nbytes)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env={**os.environ, "TIMESLICE_NODE_NAME": NODE, **(env or {})})
        self.pid = self._read(60)["ready"]


class CkptJob:
    """A job swapped by the (simulated) checkpoint backend, through lockd's API: its worker is a
    SimWorker the test starts (inside its first hold, as a job allocates) and registers."""

    def __init__(self, stub, job: str, group: str = "g"):
        self.stub, self.job, self.group = stub, job, group
        self.secret = ""
        self.grant = None
        self.worker = None

    async def open(self) -> CkptJob:
        r = await self.stub.OpenSession(lpb.OpenSessionRequest(job_id=self.job, ttl_seconds=60))
        self.secret = r.session_secret
        return self

    async def acquire(self, hint: int, timeout: float = 60):
        self.grant = await self.stub.Acquire(lpb.AcquireRequest(job_id=self.job, session_secret=self.secret,
                                                                group_id=self.group, device_bytes_hint=hint),
                                             timeout=timeout)
        return self.grant

    async def register(self, worker, nbytes: int) -> None:
        self.worker = worker
        await self.stub.RegisterWorker(lpb.WorkerRequest(job_id=self.job, session_secret=self.secret, node=NODE,
                                                         pid=worker.pid, device_bytes=nbytes))

    async def yield_(self):
        return await self.stub.Yield(lpb.YieldRequest(job_id=self.job, session_secret=self.secret,
                                                      group_id=self.group, token=self.grant.token))


async def wait_for(pred, timeout: float = 20.0, what: str = ""):
    """``await pred()`` until it is truthy (returned), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")
