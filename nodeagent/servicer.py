"""The direct gRPC API (proto/nodeagent.proto): proto in, a call to the agent's rooms, proto out.

Errors are TimesliceErrors carrying the name of their gRPC status (admission
refusals are RESOURCE_EXHAUSTED, unknown ids NOT_FOUND, bad input
INVALID_ARGUMENT); ``rpc`` maps them in one place. Snapshot, Restore and
GetOperation need the admin token (checked by the server's Gate); Status
answers anyone with the node's figures, but lists processes and jobs only to a
caller holding the token.
"""
from __future__ import annotations

from timeslice.common.server import records as R
from timeslice.common.server.auth import Authority
from timeslice.common.server.serving import rpc
from timeslice.nodeagent.direct import Operation, Operations
from timeslice.nodeagent.upkeep import Upkeep
from timeslice.proto import nodeagent_pb2 as pb
from timeslice.proto import nodeagent_pb2_grpc as pbg


def _op(o: Operation) -> pb.Operation:
    return pb.Operation(operation_id=o.operation_id, op=o.op, job_id=o.job_id, state=o.state, bytes=o.bytes,
                        elapsed_ms=o.elapsed_ms, error=o.error, pids=o.pids)


class NodeAgentServicer(pbg.NodeAgentServicer):
    def __init__(self, upkeep: Upkeep, operations: Operations, authority: Authority | None = None):
        self.upkeep, self.ops = upkeep, operations
        self.authority = authority or Authority(None)

    @rpc
    async def Snapshot(self, req, context):
        return _op(await self.ops.submit(R.SNAPSHOT, req.job_id, list(req.pids)))

    @rpc
    async def Restore(self, req, context):
        return _op(await self.ops.submit(R.RESTORE, req.job_id, list(req.pids)))

    @rpc
    async def GetOperation(self, req, context):
        return _op(self.ops.get(req.operation_id))

    @rpc
    async def Status(self, req, context):
        pictures = await self.upkeep.pictures()
        value = await self.upkeep.agent_value(pictures)
        out = pb.AgentStatus(node=value.node, backend=value.backend, version=value.version,
                             host_free_bytes=value.host_free_bytes)
        out.gpus.extend(pb.Gpu(index=g["index"], uuid=g["uuid"], total_bytes=g["total_bytes"],
                               free_bytes=g["free_bytes"]) for g in value.gpus)
        if not self.authority.allows(context):
            return out                  # which job runs which process is not for unauthenticated eyes
        for job, pic in sorted(pictures.items()):
            out.processes.extend(pb.ProcessState(pid=pid, job_id=job, state=str(state),
                                                 device_bytes=pic.bytes.get(pid, 0))
                                 for pid, state in sorted(pic.states.items()))
        return out
