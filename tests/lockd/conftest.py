"""Fixtures for lockd tests: real replicas (processes) against the real etcd."""
import pytest

from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.testing.lockd import LockdCluster, admin_channel
from timeslice.testing.rawjob import RawJob


class Job(RawJob):
    """A job speaking raw gRPC to one replica, on purpose: no failover, every error comes back as it is
    (the client library is tested elsewhere)."""

    def __init__(self, target: str, job_id: str, ttl: int = 10):
        super().__init__(job_id, [target], ttl=ttl, failover=False)


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
