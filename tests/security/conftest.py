"""A real stack to attack: etcd, one lockd replica and one node agent on a SIMULATED device, per module.

Everything an attacker talks to is a real process on loopback; the admin token
is the harness's shared one ($TIMESLICE_ADMIN_TOKEN), which the attacker's
calls do not carry unless a test says so. ``etcd_state`` is the "nothing
changed" check: every key that names the test's jobs or groups, with its value
and mod_revision.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc
import pytest

from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.agent import AgentProcess, SimWorker
from timeslice.testing.lockd import LockdCluster, admin_channel, shared_admin_token
from timeslice.testing.rawjob import RawJob

MiB = 1 << 20
NODE = "sec-node"
FAST = ["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5", "--swap-timeout", "30"]


@dataclass
class Stack:
    prefix: str
    keys: Keys
    lockd: LockdCluster
    agent: AgentProcess
    sim_dir: str
    host_dir: str
    etcd_endpoints: str

    @property
    def target(self) -> str:
        return self.lockd.replicas[0].target


@pytest.fixture(scope="module")
def stack(etcd, tmp_path_factory):
    d = tmp_path_factory.mktemp("security")
    prefix = f"/sec-{secrets.token_hex(4)}/"
    SimDevice(d / "sim", d / "host", capacity_bytes=64 * MiB)
    shared_admin_token()
    lockd = LockdCluster(etcd.endpoints_str, prefix, n=1, logdir=str(d), extra=FAST).start()
    agent = AgentProcess(etcd.endpoints_str, prefix, NODE, str(d), sim_dir=d / "sim",
                         env={"TIMESLICE_SIM_HOST_DIR": str(d / "host")},
                         extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0",
                                "--refresh-interval", "0.5"])
    try:
        agent.start()
        yield Stack(prefix, Keys(prefix), lockd, agent, str(d / "sim"), str(d / "host"), etcd.endpoints_str)
    finally:
        if agent.alive():
            agent.stop()
        lockd.stop()


@pytest.fixture
def workers(stack):
    made: list[SimWorker] = []

    def make(nbytes: int = 4 * MiB, seed: int = 1) -> SimWorker:
        w = SimWorker(stack.sim_dir, nbytes, seed, env={"TIMESLICE_SIM_HOST_DIR": stack.host_dir})
        made.append(w)
        return w.ready()

    yield make
    for w in made:
        w.stop()


@pytest.fixture
async def etcd_client(stack):
    async with EtcdClient(EtcdConfig.parse(stack.etcd_endpoints)) as c:   # the stack's etcd, not the plugin's
        yield c


async def etcd_state(client: EtcdClient, keys: Keys, *ids: str) -> dict[bytes, tuple[bytes, int]]:
    """The keys that name any of ``ids`` (jobs, groups, as a key segment) with value and mod_revision.

    Scoped to the test's own jobs and groups: lockd's housekeeping of jobs that
    earlier tests left (it deletes their intents and statuses) may run at any time.
    """
    assert ids, "name the jobs and groups whose keys must not change"
    segs = [f"/{i}/".encode() for i in ids]
    r = await client.range(ops.range_req(keys.root(), prefix=True))
    # The leader's history of finished holds (lockd/history.py) is written a moment after a
    # hold ends, whenever that was: it is a record of the past, not state an attack could change.
    return {kv.key: (kv.value, kv.mod_revision) for kv in r.kvs
            if any(seg in kv.key + b"/" for seg in segs) and not kv.key.startswith(keys.history())}


async def rpc_error(call) -> grpc.aio.AioRpcError:
    """The error ``call`` fails with (the test fails if it succeeds)."""
    try:
        got = await call
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError(f"the call succeeded: {str(got)[:300]}")


class Job(RawJob):
    """A job speaking lockd's API directly (session secret only; no admin token): the shared raw
    client on one replica with no failover, so every status comes back as lockd sent it."""

    def __init__(self, target: str, job_id: str):
        super().__init__(job_id, [target], ttl=30, rpc_timeout=10, failover=False)

    def register(self, node: str, pid: int, nbytes: int = 0):
        return self.stub.RegisterWorker(lpb.WorkerRequest(job_id=self.job_id, session_secret=self.secret,
                                                          node=node, pid=pid, device_bytes=nbytes), timeout=10)

    async def close(self) -> None:
        await self.close_session()
        await super().close()


@pytest.fixture
async def jobs(stack):
    made: list[Job] = []

    async def make(name: str) -> Job:
        j = await Job(stack.target, f"{name}-{secrets.token_hex(3)}").open()
        made.append(j)
        return j

    yield make
    for j in made:
        await j.close()


@pytest.fixture
async def admin(stack):
    """A lockd stub whose calls carry the admin token (the operator)."""
    ch = admin_channel(stack.target)
    yield lpbg.LockdStub(ch)
    await ch.close()
