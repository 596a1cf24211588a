"""Attacks on the node agent's direct API, replayed against a real agent.

Each test asserts the refusal, that the victim's process still runs and
answers, and that nothing changed in etcd.
"""
from __future__ import annotations

import argparse
import os

import grpc

from tests.security.conftest import NODE, MiB, etcd_state, rpc_error
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.nodeagent import config as C
from timeslice.proto import nodeagent_pb2 as pb
from timeslice.proto import nodeagent_pb2_grpc as pbg
from timeslice.testing.lockd import admin_channel


async def test_unauthenticated_callers_cannot_snapshot_restore_or_see_processes(stack, etcd_client, jobs, workers):
    victim = await jobs("victim")
    w = workers(4 * MiB, seed=3)
    await victim.register(NODE, w.pid, 4 * MiB)
    before = await etcd_state(etcd_client, stack.keys, victim.job_id, "mallory")
    async with grpc.aio.insecure_channel(stack.agent.target) as ch:
        stub = pbg.NodeAgentStub(ch)
        for req in (pb.OperationRequest(job_id="mallory", pids=[w.pid]), pb.OperationRequest(job_id=victim.job_id)):
            for call in (stub.Snapshot, stub.Restore):
                e = await rpc_error(call(req, timeout=10))
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        e = await rpc_error(stub.GetOperation(pb.GetOperationRequest(operation_id="x"), timeout=10))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous = await stub.Status(pb.AgentStatusRequest(), timeout=10)
    async with admin_channel(stack.agent.target, token="not-the-token-" + "x" * 20) as ch:
        e = await rpc_error(pbg.NodeAgentStub(ch).Snapshot(pb.OperationRequest(job_id=victim.job_id), timeout=10))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    async with admin_channel(stack.agent.target) as ch:
        operator = await pbg.NodeAgentStub(ch).Status(pb.AgentStatusRequest(), timeout=10)
    # The node's figures for anyone; which job runs which pid only for the token's holder.
    assert anonymous.node == NODE and anonymous.gpus and not anonymous.processes
    assert (w.pid, victim.job_id) in {(p.pid, p.job_id) for p in operator.processes}
    assert w.verify(timeout=10)
    assert await etcd_state(etcd_client, stack.keys, victim.job_id, "mallory") == before


async def test_a_job_name_does_not_reach_another_jobs_pid(stack, etcd_client, jobs, workers):
    victim, mallory = await jobs("victim"), await jobs("mallory")
    w = workers(4 * MiB, seed=4)
    await victim.register(NODE, w.pid, 4 * MiB)
    before = await etcd_state(etcd_client, stack.keys, victim.job_id, mallory.job_id)
    async with admin_channel(stack.agent.target) as ch:          # even an operator's call names the right job
        stub = pbg.NodeAgentStub(ch)
        for call in (stub.Snapshot, stub.Restore):
            e = await rpc_error(call(pb.OperationRequest(job_id=mallory.job_id, pids=[w.pid]), timeout=10))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
            assert "not registered workers" in e.details()
    assert w.verify(timeout=10)
    assert await etcd_state(etcd_client, stack.keys, victim.job_id, mallory.job_id) == before


async def test_init_the_agent_and_lockd_are_never_acted_on(stack, etcd_client, jobs):
    mallory = await jobs("mallory")
    protected = [1, stack.agent.pid, stack.lockd.replicas[0].pid]
    for pid in protected:
        # lockd refuses these registrations (tests/security/test_pid_ownership.py); written past it here,
        # as one made before the agent said which pids are protected would be, the agent refuses them still.
        val = R.WorkerValue(pid, NODE, 0, R.now_ms())
        await etcd_client.txn([], [ops.put(stack.keys.worker(mallory.job_id, NODE, pid), val.dump(), mallory.lease)])
    before = await etcd_state(etcd_client, stack.keys, mallory.job_id)
    async with admin_channel(stack.agent.target) as ch:
        stub = pbg.NodeAgentStub(ch)
        for pid in protected:
            e = await rpc_error(stub.Snapshot(pb.OperationRequest(job_id=mallory.job_id, pids=[pid]), timeout=10))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (pid, e)
        e = await rpc_error(stub.Snapshot(pb.OperationRequest(job_id=mallory.job_id), timeout=10))
        assert e.code() == grpc.StatusCode.NOT_FOUND, e           # nothing of mallory's may be moved
    assert stack.lockd.replicas[0].alive() and stack.agent.alive()
    assert await etcd_state(etcd_client, stack.keys, mallory.job_id) == before


async def test_pids_per_request_are_bounded(stack, etcd_client, jobs, workers):
    victim = await jobs("victim")
    w = workers(4 * MiB, seed=5)
    await victim.register(NODE, w.pid, 4 * MiB)
    before = await etcd_state(etcd_client, stack.keys, victim.job_id)
    async with admin_channel(stack.agent.target) as ch:
        stub = pbg.NodeAgentStub(ch)
        for n in (65, 400_000):
            pids = [w.pid] + list(range(1_000_000, 1_000_000 + n - 1))
            e = await rpc_error(stub.Snapshot(pb.OperationRequest(job_id=victim.job_id, pids=pids), timeout=20))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "max_pids_per_request" in e.details() and len(e.details()) < 1024
    assert w.verify(timeout=10)
    assert await etcd_state(etcd_client, stack.keys, victim.job_id) == before


async def test_malformed_agent_request_is_invalid_argument(stack):
    async with admin_channel(stack.agent.target) as ch:
        raw = ch.unary_unary("/timeslice.v1.NodeAgent/Snapshot", request_serializer=None,
                             response_deserializer=None)
        e = await rpc_error(raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert "class" not in e.details() and "Error" not in e.details()


def test_the_agent_listens_on_loopback_unless_told(monkeypatch):
    for var in [v for v in os.environ if v.startswith("TIMESLICE_")]:
        monkeypatch.delenv(var)
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    cfg = C.from_args(p.parse_args(["--node", "n1"]))
    assert cfg.listen.startswith("127.0.0.1:")
    assert C.AgentConfig(node="n1").listen.startswith("127.0.0.1:")
