"""The agent's direct gRPC API (Snapshot / Restore / GetOperation / Status), over a real channel."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from agenthelpers import NODE, MiB, register, status
from grpc_health.v1 import health_pb2, health_pb2_grpc

from timeslice.common.server import records as R
from timeslice.proto import nodeagent_pb2 as pb
from timeslice.proto import nodeagent_pb2_grpc as pbg
from timeslice.testing.lockd import admin_channel


async def finished(stub, op: pb.Operation, timeout: float = 10.0) -> pb.Operation:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while op.state in ("pending", "running"):
        assert loop.time() < deadline, f"operation still {op.state}"
        await asyncio.sleep(0.02)
        op = await stub.GetOperation(pb.GetOperationRequest(operation_id=op.operation_id))
    return op


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code()


async def test_direct_snapshot_and_restore_of_a_registered_job(client, keys, agents, workers):
    agent = agents()
    w = workers(4 * MiB, seed=5)
    await register(client, keys, "job-a", NODE, w.pid)
    async with admin_channel(agent.target) as ch:
        stub = pbg.NodeAgentStub(ch)
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="timeslice.v1.NodeAgent"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        op = await stub.Snapshot(pb.OperationRequest(job_id="job-a"))
        assert op.operation_id and op.op == "snapshot" and list(op.pids) == [w.pid]
        op = await finished(stub, op)
        assert (op.state, op.bytes, op.error) == ("done", 4 * MiB, "") and op.elapsed_ms > 0

        st = await stub.Status(pb.AgentStatusRequest())
        assert (st.node, st.backend) == (NODE, "sim") and st.host_free_bytes > 0
        assert [(g.uuid, g.total_bytes, g.free_bytes) for g in st.gpus] == [("sim0", 64 * MiB, 64 * MiB)]
        assert [(p.pid, p.job_id, p.state, p.device_bytes) for p in st.processes] == \
            [(w.pid, "job-a", "checkpointed", 4 * MiB)]
        # The leader's picture follows: no intent here, so the status records the direct op.
        s = await status(client, keys, NODE, "job-a")
        assert (s.state, s.op, s.outcome, s.intent_revision, s.device_bytes) == \
            (R.SNAPSHOTTED, R.SNAPSHOT, R.OK, 0, 4 * MiB)

        op = await finished(stub, await stub.Restore(pb.OperationRequest(job_id="job-a")))
        assert (op.state, op.bytes) == ("done", 4 * MiB)
        assert w.verify()
        assert (await status(client, keys, NODE, "job-a")).state == R.RUNNING

        assert await code_of(stub.GetOperation(pb.GetOperationRequest(operation_id="nope"))) == \
            grpc.StatusCode.NOT_FOUND
        assert await code_of(stub.Snapshot(pb.OperationRequest(job_id="bad/id"))) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(stub.Snapshot(pb.OperationRequest(job_id="job-a", pids=[0]))) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(stub.Snapshot(pb.OperationRequest(job_id="nobody"))) == grpc.StatusCode.NOT_FOUND


async def test_direct_api_on_named_pids_refuses_what_would_not_fit(client, keys, agents, workers):
    agent = agents()
    a = workers(40 * MiB, seed=1)
    await register(client, keys, "svc", NODE, a.pid)
    async with admin_channel(agent.target) as ch:
        stub = pbg.NodeAgentStub(ch)
        # The job names some of its registered pids.
        op = await finished(stub, await stub.Snapshot(pb.OperationRequest(job_id="svc", pids=[a.pid])))
        assert (op.state, op.bytes) == ("done", 40 * MiB)
        b = workers(40 * MiB, seed=2)
        # The snapshot of svc is 40 MiB, 24 MiB are free: refused before touching anything.
        assert await code_of(stub.Restore(pb.OperationRequest(job_id="svc"))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        b.stop()
        op = await finished(stub, await stub.Restore(pb.OperationRequest(job_id="svc")))
        assert op.state == "done" and list(op.pids) == [a.pid]
        assert a.verify()
        assert await code_of(stub.Snapshot(pb.OperationRequest(job_id="svc", pids=[b.pid]))) == \
            grpc.StatusCode.NOT_FOUND
