"""Pids belong to the job that attested them, against a real agent, lockd and etcd.

A job's process proves over the node-local channel that it is the job's; the agent
tells lockd (``nodes/<node>/attested/<pid>``) before it welcomes the process. So no
other job can register that pid, and a job that registered it first (a squatter) does
not lock the owner out. The node's own servers cannot be registered by anyone.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from tests.security.conftest import NODE, etcd_state, rpc_error
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.testing.procs import track, untrack

ATTEST = """
import sys
from timeslice.cooperative import Attestation, CooperativeWorker
print("READY", flush=True)
sys.stdin.readline()                       # attest when told
w = CooperativeWorker(sys.argv[1], sys.argv[2], Attestation(), sys.argv[3], sys.argv[4]).start()
print("ATTESTED", w.pid, flush=True)
sys.stdin.read()
"""


class Process:
    """A process of the owner's job: it attests over the channel when told (as register_worker does)."""

    def __init__(self, stack, job):
        self.p = subprocess.Popen([sys.executable, "-c", ATTEST, job.job_id, job.secret, NODE, stack.agent.socket],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        track(self.p)
        self.pid = self.p.pid
        assert self._line() == "READY"

    def _line(self) -> str:
        """The next line of ours (the client library logs to stdout too)."""
        while True:
            line = self.p.stdout.readline()
            assert line, f"the process exited ({self.p.poll()})"
            if line.startswith(("READY", "ATTESTED")):
                return line.strip()

    def attest(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        assert self._line() == f"ATTESTED {self.pid}"

    def end(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)
        untrack(self.p.pid)


@pytest.fixture
def processes(stack):
    made: list[Process] = []

    def make(job) -> Process:
        made.append(Process(stack, job))
        return made[-1]
    yield make
    for p in made:
        p.end()


async def _registered(etcd_client, keys, job: str, pid: int) -> bool:
    r = await etcd_client.range(ops.range_req(keys.worker(job, NODE, pid)))
    return bool(r.kvs)


async def test_a_pid_another_job_attested_cannot_be_registered(stack, etcd_client, jobs, processes):
    owner, squatter = await jobs("owner"), await jobs("squatter")
    proc = processes(owner)
    proc.attest()
    before = await etcd_state(etcd_client, stack.keys, owner.job_id, squatter.job_id)
    e = await rpc_error(squatter.register(NODE, proc.pid))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "another job" in e.details(), e
    assert owner.job_id not in e.details()                    # whose it is is not told
    assert await etcd_state(etcd_client, stack.keys, owner.job_id, squatter.job_id) == before
    await owner.register(NODE, proc.pid)                      # the owner registers it
    assert await _registered(etcd_client, stack.keys, owner.job_id, proc.pid)


async def test_a_squatter_that_registered_first_does_not_lock_the_owner_out(stack, etcd_client, jobs, processes):
    owner, squatter = await jobs("owner"), await jobs("squatter")
    proc = processes(owner)
    await squatter.register(NODE, proc.pid)                   # before the process attested: nobody can know
    proc.attest()
    await owner.register(NODE, proc.pid)
    assert await _registered(etcd_client, stack.keys, owner.job_id, proc.pid)
    assert not await _registered(etcd_client, stack.keys, squatter.job_id, proc.pid)  # the squat is gone
    e = await rpc_error(squatter.register(NODE, proc.pid))    # and cannot come back
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e


async def test_system_processes_are_refused_at_registration(stack, etcd, etcd_client, jobs):
    mallory = await jobs("mallory")
    system = {"init": 1, "the node agent": stack.agent.pid, "lockd": stack.lockd.replicas[0].pid,
              "etcd": etcd.members[0].pid}
    before = await etcd_state(etcd_client, stack.keys, mallory.job_id)
    for what, pid in system.items():
        e = await rpc_error(mallory.register(NODE, pid))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "system process" in e.details(), (what, e)
    assert await etcd_state(etcd_client, stack.keys, mallory.job_id) == before
    # The agent says which they are; on a node without an agent only init is known.
    r = await etcd_client.range(ops.range_req(stack.keys.protected(NODE)))
    protected = R.ProtectedValue.load(r.kvs[0].value).pids
    assert {str(stack.agent.pid), str(stack.lockd.replicas[0].pid)} <= set(protected)
    await mallory.register("sec-no-agent", stack.agent.pid)   # another node's pid: not this agent's word
    e = await rpc_error(mallory.register("sec-no-agent", 1))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_attestation_goes_when_the_process_does(stack, etcd_client, jobs, processes):
    owner = await jobs("owner")
    proc = processes(owner)
    proc.attest()
    key = stack.keys.attested(NODE, proc.pid)
    r = await etcd_client.range(ops.range_req(key))
    assert R.AttestedValue.load(r.kvs[0].value).job == owner.job_id
    proc.end()
    deadline = time.monotonic() + 20
    while (await etcd_client.range(ops.range_req(key))).kvs:
        assert time.monotonic() < deadline, "the exited process's attestation stayed"
        await asyncio.sleep(0.1)
