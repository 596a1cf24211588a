"""No job can squat a pid between its owner's attestation and its owner's registration.

lockd refuses a registration of a pid another job attested, and removes a squatter's registration
when the owner registers, by what the node agent tells it in etcd (``nodes/<node>/attested/<pid>``,
lockd/ownership.py). Two ways that word was missing when the owner registered, and the owner was
then PERMISSION_DENIED for as long as the squatter lived:

* the agent welcomed a worker even when it could not write the record (best effort, 2 s): a worker
  attested while the agent's etcd was slow registered unseen. Now the welcome waits for the record
  (retried, bounded; else UNAVAILABLE and the worker says hello again);
* a launcher that attested registers a rank it started: the agent counts the rank as the job's
  (its nearest attested ancestor's), but had told lockd nothing about it. Now the library vouches
  for the rank over the channel first (``vouch``), and the agent records it.
"""
from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
import time

import grpc

from tests.security.conftest import NODE, MiB, Job, rpc_error
from tests.security.test_pid_ownership import Process
from timeslice.common.server import records as R
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdCluster
from timeslice.testing.procs import track, untrack

FAST = ["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5"]

LAUNCHER = """
import subprocess, sys
from timeslice import OrchestratorClient
client = OrchestratorClient(target=sys.argv[1], job_id=sys.argv[2])
rank = subprocess.Popen(["sleep", "120"])
print("RANK", rank.pid, flush=True)
sys.stdin.readline()                                   # register the rank when told
try:
    client.register_worker(pid=rank.pid, node=sys.argv[3])
    print("REGISTERED", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:300], flush=True)
sys.stdin.readline()
rank.kill()
client.close()
"""


async def _registered(client, keys, job: str, pid: int) -> bool:
    return bool((await client.range(ops.range_req(keys.worker(job, NODE, pid)))).kvs)


def _line(p: subprocess.Popen, prefixes: tuple[str, ...], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        assert line, f"process {p.pid} exited ({p.poll()})"
        if line.startswith(prefixes):
            return line.strip()
    raise AssertionError(f"never said any of {prefixes}")


async def test_a_rank_a_launcher_started_cannot_be_squatted_before_the_launcher_registers_it(
        stack, etcd_client, jobs):
    squatter = await jobs("squatter")
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER, stack.target, "launcher-job", NODE],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                         env={**os.environ, "TIMESLICE_AGENT_SOCKET": stack.agent.socket,
                              "TIMESLICE_NODE_NAME": NODE})
    track(p)
    try:
        rank = int(_line(p, ("RANK",)).split()[1])
        await squatter.register(NODE, rank)                  # first, before the owner said anything
        p.stdin.write("go\n")
        p.stdin.flush()
        said = _line(p, ("REGISTERED", "FAILED"))
        assert said == "REGISTERED", f"the owner was locked out of its own rank: {said}"
        assert await _registered(etcd_client, stack.keys, "launcher-job", rank)
        assert not await _registered(etcd_client, stack.keys, squatter.job_id, rank)   # the squat is gone
        e = await rpc_error(squatter.register(NODE, rank))   # and cannot come back
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
        kv = (await etcd_client.range(ops.range_req(stack.keys.attested(NODE, rank)))).kvs
        assert kv and R.AttestedValue.load(kv[0].value).job == "launcher-job"
        assert stack.agent.events("worker_vouched", pid=rank)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        untrack(p.pid)


async def test_a_worker_is_welcomed_only_once_lockd_can_see_its_attestation(etcd, key_prefix, tmp_path):
    """The agent's lease is gone (revoked here, as a lease lost in an etcd hiccup is) and the agent
    has not noticed yet (its keepalive comes every 10 s): a record written on it is refused. The
    worker must not be welcomed until the record is in etcd, on the agent's next lease."""
    keys = Keys(key_prefix)
    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=64 * MiB)
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path), extra=FAST).start()
    agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), sim_dir=tmp_path / "sim",
                         env={"TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host")},
                         extra=["--agent-lease-ttl", "30", "--refresh-interval", "5"]).start()
    client = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    owner, squatter = Job(lockd.replicas[0].target, "owner"), Job(lockd.replicas[0].target, "squatter")
    proc = None
    try:
        await owner.open()
        await squatter.open()
        proc = Process(type("S", (), {"agent": agent})(), owner)
        lease = (await client.range(ops.range_req(keys.agent(NODE)))).kvs[0].lease
        await asyncio.to_thread(etcd.revoke_lease, lease)
        lines = Lines(proc)
        proc.p.stdin.write("go\n")
        proc.p.stdin.flush()
        said = await asyncio.to_thread(lines.wait, 60.0)
        assert said == f"ATTESTED {proc.pid}", said
        kv = (await client.range(ops.range_req(keys.attested(NODE, proc.pid)))).kvs
        assert kv and R.AttestedValue.load(kv[0].value).job == "owner", "welcomed before lockd could see whose it is"
        e = await rpc_error(squatter.register(NODE, proc.pid))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
        await owner.register(NODE, proc.pid)                 # as the library does right after the welcome
        assert await _registered(client, keys, "owner", proc.pid)
    finally:
        if proc is not None:
            proc.end()
        for j in (owner, squatter):
            await j.close()
        await client.close()
        agent.stop()
        lockd.stop()


class Lines:
    """The ATTESTED line of a Process, read on one thread: waited for with a timeout, never lost."""

    def __init__(self, proc: Process):
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: self.q.put(proc._line()), daemon=True).start()

    def wait(self, timeout: float) -> str | None:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None
