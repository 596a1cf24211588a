"""Fixtures for the node agent loop's tests: real etcd, real agent processes on a
SIMULATED device, real worker processes holding checksummed bytes."""
from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from agenthelpers import NODE, MiB

from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.agent import AgentProcess, SimWorker
from timeslice.testing.lockd import LockdCluster, admin_channel


@pytest.fixture
def sim_dir(tmp_path):
    """A 64 MiB simulated device of the test's own."""
    d = tmp_path / "sim"
    SimDevice(d, tmp_path / "host", capacity_bytes=64 * MiB)
    return d


@pytest.fixture
def keys(key_prefix) -> Keys:
    return Keys(key_prefix)


@pytest.fixture
def client(etcd_client):
    """The agent tests' name for the plugin's ``etcd_client``."""
    return etcd_client


@pytest.fixture
def agents(etcd, key_prefix, tmp_path, sim_dir):
    """agents(node=NODE, extra=[...], start=True) -> AgentProcess on the test's device; stopped at teardown.

    Copies are unthrottled unless ``extra`` sets the simulated bandwidth.
    """
    started: list[AgentProcess] = []

    def make(node: str = NODE, extra: list[str] | None = None, start: bool = True, **kw) -> AgentProcess:
        extra = list(extra or [])
        for flag in ("--sim-checkpoint-gbps", "--sim-restore-gbps"):
            if flag not in extra:
                extra += [flag, "0"]
        a = AgentProcess(etcd.endpoints_str, key_prefix, node, str(tmp_path), sim_dir=sim_dir,
                         env={"TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host")}, extra=extra, **kw)
        started.append(a)
        return a.start() if start else a

    yield make
    for a in started:
        if a.alive():
            a.resume()
            a.stop()


@pytest.fixture
def workers(sim_dir, tmp_path):
    """workers(nbytes, seed) -> a ready SimWorker on the test's device; all stopped at teardown."""
    made: list[SimWorker] = []

    def make(nbytes: int = 4 * MiB, seed: int = 1, step_ms: float = 1.0) -> SimWorker:
        w = SimWorker(sim_dir, nbytes, seed, step_ms, env={"TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host")})
        made.append(w)
        return w.ready()

    yield make
    for w in made:
        w.stop()


@dataclass
class NodeStack:
    stub: lpbg.LockdStub      # an admin channel to the replica
    lockd: LockdCluster
    agent: AgentProcess
    dev: SimDevice


@pytest.fixture
def lockd_node(etcd, key_prefix, agents, sim_dir, tmp_path):
    """lockd_node(capacity, group="g", isolation="", lockd_extra=(), agent_extra=(), context_bytes=None,
    slack=None, sharing="") -> async context of a NodeStack: the test's SIMULATED device resized to
    ``capacity`` bytes (charging each process ``context_bytes`` and the allocator's ``slack`` where given),
    this node's agent, one lockd replica (their extra flags), and ``group`` over the node (``sharing``:
    its policy). The replica is stopped on the way out."""
    @asynccontextmanager
    async def make(capacity: int, group: str = "g", isolation: str = "", lockd_extra=(), agent_extra=(),
                   context_bytes: int | None = None, slack: float | None = None, sharing: str = ""):
        dev = SimDevice(sim_dir, capacity_bytes=capacity, context_bytes=context_bytes, slack=slack)
        lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path),
                             extra=list(lockd_extra)).start()
        agent = agents(extra=list(agent_extra))
        try:
            async with admin_channel(lockd.replicas[0].target) as ch:
                stub = lpbg.LockdStub(ch)
                await stub.CreateGroup(lpb.CreateGroupRequest(group_id=group, nodes=[lpb.NodeSpec(node=NODE)],
                                                              isolation=isolation, sharing=sharing))
                yield NodeStack(stub, lockd, agent, dev)
        finally:
            lockd.stop()
    return make
