"""The node-local channel under a flood of silent connections, against a real agent, lockd and etcd.

Several hostile processes of the same user hold as many connections to the agent's socket
as they can and never say hello. Meanwhile a real cooperative job connects through the
public client and a handoff with a swap (the resident job paused over its channel)
completes: the agent keeps accepting, bounds what waits for a hello per process, per
user and in total, and evicts the oldest waiting connection of whoever floods.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.security.conftest import NODE, MiB
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.proto import lockd_pb2 as lpb
from timeslice.testing.procs import track, untrack

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
WEIGHTS, KV = 40 * MiB, 8 * MiB
HINT = 1 * MiB + WEIGHTS + KV               # two such jobs do not fit on the 64 MiB device


def _spawn(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    track(p)
    return p


def _line(p: subprocess.Popen, prefix: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"process {p.pid} exited ({p.poll()}) before saying {prefix!r}")
        if line.startswith(prefix):
            return line
    raise AssertionError(f"process {p.pid} never said {prefix!r}")


def _end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)
    untrack(p.pid)


class CoopJob:
    """tests/scripts/coop_job.py: a cooperative job on the public client, one command per line."""

    def __init__(self, stack, job: str):
        self.p = _spawn([sys.executable, os.path.join(SCRIPTS, "coop_job.py"), stack.target, job, NODE,
                         stack.sim_dir, stack.agent.socket, f"weights:{WEIGHTS}:offload,kv:{KV}:discard"],
                        env={"TIMESLICE_NODE_NAME": NODE, "TIMESLICE_SIM_HOST_DIR": stack.host_dir})
        _line(self.p, '{"ready"')

    def __call__(self, cmd: str, timeout: float = 90) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(_line(self.p, "{", timeout))


@pytest.fixture
def procs():
    made: list = []
    yield made
    for p in made:
        _end(p.p if isinstance(p, CoopJob) else p)


async def test_a_worker_connects_and_a_swap_completes_while_others_flood_the_channel(stack, admin, etcd_client,
                                                                                      procs):
    await admin.CreateGroup(lpb.CreateGroupRequest(group_id="flood-g", nodes=[lpb.NodeSpec(node=NODE)]), timeout=10)
    flooders = [_spawn([sys.executable, os.path.join(SCRIPTS, "channel_flood.py"), stack.agent.socket, "8000"])
                for _ in range(3)]
    procs.extend(flooders)
    for f in flooders:
        _line(f, "FLOODING")                 # each has tried its 8000 connects: the flood is on
    a = CoopJob(stack, "flood-a")
    procs.append(a)
    got = a(f"acquire flood-g {HINT}")       # the first hold connects the channel (cooperate)
    assert got["ok"], got
    assert a("yield flood-g")["ok"]
    b = CoopJob(stack, "flood-b")
    procs.append(b)
    got = b(f"acquire flood-g {HINT}")       # a is paused over its channel to make room
    assert got["ok"], got
    r = await etcd_client.range(ops.range_req(stack.keys.status(NODE, "flood-a")))
    st = R.StatusValue.load(r.kvs[0].value)
    assert (st.state, st.outcome, st.bytes) == (R.SNAPSHOTTED, R.OK, WEIGHTS)
    assert b("yield flood-g")["ok"]
    got = a(f"acquire flood-g {HINT}")       # and resumed
    assert got["ok"] and got["restored"], got
    assert a("verify weights")["match"]
    assert a("yield flood-g")["ok"]
    for f in flooders:                       # the flood went on all along
        assert f.poll() is None
    assert stack.agent.alive()
