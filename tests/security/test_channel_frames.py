"""Malformed frames on the node-local channel, against a real agent (SIMULATED device) and real etcd.

Each frame, from a hello-less stranger or from a welcomed worker that the agent has
paused and frozen, gets a refusal frame (``refused``, INVALID_ARGUMENT); a welcomed
worker's connection is then closed and its disconnect handling runs: the freeze is
lifted (a process on its way out must not wait on it) and the agent says it left.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from timeslice.common import channel as C
from timeslice.common import swaps
from timeslice.common.server import records as R
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import LOCKED, RUNNING, SimDevice
from timeslice.launcher.procs import log_events
from timeslice.testing.agent import AgentProcess
from timeslice.testing.procs import track, untrack

MiB = 1 << 20
NODE = "frames-node"
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "raw_channel_worker.py")


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def obj(msg: dict) -> bytes:
    return frame(json.dumps(msg).encode())


#: name -> the bytes a worker sends after its welcome
AFTER_WELCOME = {
    "nested JSON past Python's stack": frame(b"[" * 60_000),
    "nested deeper than the protocol": obj({"type": "state", "paused": [[[[[[[[[["w"]]]]]]]]]]}),
    "an unhashable request id": obj({"type": "done", "id": [1], "ok": True}),
    "a string for a count": obj({"type": "done", "id": 1, "ok": True, "bytes_moved": "lots"}),
    "paused that is not a list": obj({"type": "state", "paused": "w"}),
    "region sizes that are not numbers": obj({"type": "state", "region_bytes": {"w": [1]}}),
    "a sync id that is not a positive integer": obj({"type": "state", "paused": [], "sync": [1]}),
    "a frame past the size limit": struct.pack(">I", 1 << 30),
    "a body that is not JSON": frame(b"\xff\xfe not json"),
}

#: name -> a hello (or what stands for one) from a connection the agent has not welcomed
HELLOS = {
    "nested JSON past Python's stack": frame(b"[" * 60_000),
    "an unhashable tag policy": obj({"type": "hello", "job": "j", "secret": "s", "tags": {"w": ["offload"]}}),
    "a job that is not a string": obj({"type": "hello", "job": {"j": 1}, "secret": "s", "tags": {}}),
    "paused that is not a list": obj({"type": "hello", "job": "j", "secret": "s", "tags": {}, "paused": 7}),
    "a frame past the size limit": struct.pack(">I", 1 << 30),
}


class Node:
    def __init__(self, agent: AgentProcess, keys: Keys, sim_dir: str, host_dir: str, etcd: EtcdClient):
        self.agent, self.keys, self.sim_dir, self.host_dir, self.etcd = agent, keys, sim_dir, host_dir, etcd


@pytest.fixture(scope="module")
def node(etcd, tmp_path_factory):
    d = tmp_path_factory.mktemp("frames")
    SimDevice(d / "sim", d / "host", capacity_bytes=64 * MiB)
    prefix = f"/frames-{secrets.token_hex(4)}/"
    agent = AgentProcess(etcd.endpoints_str, prefix, NODE, str(d), sim_dir=d / "sim",
                         env={"TIMESLICE_SIM_HOST_DIR": str(d / "host")},
                         extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0", "--freeze-parked"])
    agent.start()
    try:
        yield agent, Keys(prefix), str(d / "sim"), str(d / "host")
    finally:
        agent.stop()


@pytest.fixture
async def stack(node, etcd):
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    await c.connect()
    yield Node(*node, c)
    await c.close()


async def _put(client: EtcdClient, key: bytes, value: bytes) -> int:
    return (await client.txn([], [ops.put(key, value)])).header.revision


async def _until(pred, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


class RawWorker:
    def __init__(self, stack: Node, job: str, secret: str):
        self.p = subprocess.Popen([sys.executable, SCRIPT, stack.agent.socket, job, secret, stack.sim_dir],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env={**os.environ, "TIMESLICE_SIM_HOST_DIR": stack.host_dir})
        track(self.p)
        self.pid = self.p.pid
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self._lines.put(line.strip())
        self._lines.put("")

    def said(self, prefix: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the worker never said {prefix!r}") from None
            if not line:
                raise AssertionError(f"the worker exited ({self.p.poll()}) before saying {prefix!r}")
            if line.startswith(prefix):
                return line

    def send(self, raw: bytes) -> None:
        self.p.stdin.write(f"send {raw.hex()}\n")
        self.p.stdin.flush()

    def end(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)
        untrack(self.p.pid)


def _agent_said(agent: AgentProcess, event: str, pid: int) -> bool:
    return any(e.get("event") == event and e.get("pid") == pid for e in log_events(agent.log_path))


@pytest.mark.parametrize("name", list(AFTER_WELCOME))
async def test_a_malformed_frame_from_a_paused_worker_is_refused_and_its_freeze_lifted(stack, name):
    job, secret = f"frames-{secrets.token_hex(3)}", secrets.token_hex(16)
    await _put(stack.etcd, stack.keys.session(job), R.SessionValue(1, hashlib.sha256(secret.encode()).hexdigest()).dump())
    w = RawWorker(stack, job, secret)
    try:
        assert w.said("WELCOME") == f"WELCOME {w.pid}"
        await _put(stack.etcd, stack.keys.worker(job, NODE, w.pid),
                   R.WorkerValue(w.pid, NODE, MiB, R.now_ms(), swap=swaps.COOPERATIVE, tags={"w": "offload"}).dump())
        rev = await _put(stack.etcd, stack.keys.intent(NODE, job),
                         R.IntentValue(R.SNAPSHOT, job, "g", 7, 1, R.now_ms()).dump())

        async def snapshotted():
            r = await stack.etcd.range(ops.range_req(stack.keys.status(NODE, job)))
            st = R.StatusValue.load(r.kvs[0].value) if r.kvs else None
            return st is not None and st.intent_revision == rev and st.outcome == R.OK
        await _until(snapshotted, "the worker paused through an intent")
        w.said("PAUSED")
        dev = SimDevice(stack.sim_dir)
        assert dev.read_state(w.pid)["state"] == LOCKED          # paused and frozen (--freeze-parked)

        w.send(AFTER_WELCOME[name])
        reply = json.loads(w.said("REPLY").split(" ", 1)[1])
        assert (reply["type"], reply["code"]) == ("refused", "INVALID_ARGUMENT"), reply
        w.said("EOF")
        await _until(lambda: dev.read_state(w.pid)["state"] == RUNNING, "the freeze lifted")
        await _until(lambda: _agent_said(stack.agent, "channel_worker_disconnected", w.pid), "the agent saw it go")
        assert stack.agent.alive()
    finally:
        w.end()


@pytest.mark.parametrize("name", list(HELLOS))
async def test_a_malformed_hello_is_refused(stack, name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    try:
        s.connect(stack.agent.socket)
        s.sendall(HELLOS[name])
        reply = C.recv(s)
        assert (reply["type"], reply["code"]) == ("refused", "INVALID_ARGUMENT"), reply
        assert s.recv(1) == b""                                   # and closed
    finally:
        s.close()
    assert stack.agent.alive()
