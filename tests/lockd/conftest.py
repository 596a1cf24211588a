"""Fixtures for lockd tests: real replicas (processes) against the real etcd."""
import grpc
import pytest

from timeslice.testing.lockd import LockdCluster, admin_channel
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg


class Job:
    """A job speaking raw gRPC to one replica (the client library is tested elsewhere)."""

    def __init__(self, target: str, job_id: str, ttl: int = 10):
        self.job_id, self.ttl = job_id, ttl
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pbg.LockdStub(self.channel)
        self.secret = ""
        self.lease = 0

    async def open(self) -> "Job":
        r = await self.stub.OpenSession(pb.OpenSessionRequest(job_id=self.job_id, ttl_seconds=self.ttl))
        self.secret, self.lease = r.session_secret, r.lease_id
        return self

    async def acquire(self, group: str, timeout: float = 30, hint: int = 0) -> pb.AcquireReply:
        return await self.stub.Acquire(pb.AcquireRequest(job_id=self.job_id, session_secret=self.secret,
                                                         group_id=group, device_bytes_hint=hint), timeout=timeout)

    async def yield_(self, group: str, token: int) -> pb.YieldReply:
        return await self.stub.Yield(pb.YieldRequest(job_id=self.job_id, session_secret=self.secret,
                                                     group_id=group, token=token), timeout=10)

    async def keepalive(self) -> int:
        r = await self.stub.KeepAlive(pb.SessionRef(job_id=self.job_id, session_secret=self.secret), timeout=5)
        return r.ttl_seconds

    async def close(self) -> None:
        await self.channel.close()


@pytest.fixture
def lockd3(etcd, key_prefix, tmp_path):
    cluster = LockdCluster(etcd.endpoints_str, key_prefix, n=3, logdir=str(tmp_path),
                           extra=["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5",
                                  "--swap-timeout", "30"])
    cluster.start()
    yield cluster
    cluster.stop()


async def admin(target: str):
    ch = admin_channel(target)          # every call carries the admin token (CreateGroup/DeleteGroup need it)
    return ch, pbg.LockdStub(ch)
