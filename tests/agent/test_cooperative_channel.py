"""The cooperative backend's protocol against a real agent (SIMULATED device) and real etcd.

The test process itself is the cooperative worker: it opens the agent's Unix
socket, the agent learns its pid from SO_PEERCRED and its job from the session
secret (whose SHA-256 the test writes where lockd would). Intents are written
as the leader writes them. What is checked: pause/resume through intents with
bytes and states reported, fencing by token, the deadline, authentication, a
registration that names another job's process, a worker that dies mid-pause.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time

import pytest
from agenthelpers import NODE, MiB, answered, intent, put, status

from timeslice.common import swaps
from timeslice.common.channel import ChannelError
from timeslice.common.server import records as R
from timeslice.common.sim.device import SimDevice
from timeslice.cooperative import CallbackMemory, CooperativeWorker

SECRET = "s3cret-of-the-cooperative-job"


async def session(client, keys, job: str, secret: str = SECRET) -> None:
    await put(client, keys.session(job), R.SessionValue(1, hashlib.sha256(secret.encode()).hexdigest()).dump())


async def register(client, keys, job: str, pid: int, tags: dict) -> None:
    val = R.WorkerValue(pid, NODE, 0, R.now_ms(), swap=swaps.COOPERATIVE, tags=tags)
    await put(client, keys.worker(job, NODE, pid), val.dump())


class Recorder:
    """A pause/resume pair that records its calls (and can be told to be slow or to fail)."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[str] = []
        self.delay = delay

    def pause(self):
        time.sleep(self.delay)
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")


def worker(agent, job: str, rec: Recorder, nbytes: int = 3 * MiB, secret: str = SECRET) -> CooperativeWorker:
    mem = CallbackMemory(rec.pause, rec.resume, nbytes, device="sim0", tag="weights")
    return CooperativeWorker(job, secret, mem, NODE, agent.socket)


async def test_pause_and_resume_through_intents(client, keys, agents):
    agent = agents()
    await session(client, keys, "coop-a")
    rec = Recorder()
    w = worker(agent, "coop-a", rec).start()
    try:
        assert w.pid == os.getpid()                    # the kernel's word, not ours
        await register(client, keys, "coop-a", w.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "coop-a", R.SNAPSHOT, token=5)
        st = await answered(client, keys, NODE, "coop-a", rev)
        assert (st.outcome, st.state, st.bytes, st.device_bytes) == (R.OK, R.SNAPSHOTTED, 3 * MiB, 3 * MiB)
        assert rec.calls == ["pause"] and w.paused == ["weights"]
        # An older token is fenced out before the worker is asked anything.
        rev = await intent(client, keys, NODE, "coop-a", R.RESTORE, token=4)
        st = await answered(client, keys, NODE, "coop-a", rev)
        assert st.outcome == R.REFUSED and rec.calls == ["pause"]
        rev = await intent(client, keys, NODE, "coop-a", R.RESTORE, token=6)
        st = await answered(client, keys, NODE, "coop-a", rev)
        assert (st.outcome, st.state, st.bytes) == (R.OK, R.RUNNING, 3 * MiB)
        assert rec.calls == ["pause", "resume"] and w.paused == []
    finally:
        w.close()


async def test_a_worker_past_its_deadline_fails_the_swap_and_loses_nothing(client, keys, agents):
    agent = agents(extra=["--swap-deadline-s", "1"])
    await session(client, keys, "coop-slow")
    rec = Recorder(delay=3.0)
    w = worker(agent, "coop-slow", rec).start()
    try:
        await register(client, keys, "coop-slow", w.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "coop-slow", R.SNAPSHOT, token=7)
        st = await answered(client, keys, NODE, "coop-slow", rev, timeout=20)
        assert st.outcome == R.FAILED and "did not answer pause within" in st.error
        # The late answer is believed: the job shows as snapshotted (its bytes are in its own backup).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (await status(client, keys, NODE, "coop-slow")).state != R.SNAPSHOTTED:
            await agent_refresh_pause()
        assert (await status(client, keys, NODE, "coop-slow")).state == R.SNAPSHOTTED
        rev = await intent(client, keys, NODE, "coop-slow", R.RESTORE, token=8)
        st = await answered(client, keys, NODE, "coop-slow", rev, timeout=20)
        assert (st.outcome, st.state) == (R.OK, R.RUNNING) and rec.calls == ["pause", "resume"]
    finally:
        w.close()


async def agent_refresh_pause():
    import asyncio
    await asyncio.sleep(0.2)


async def test_the_channel_needs_the_jobs_secret(client, keys, agents):
    agent = agents()
    await session(client, keys, "coop-b")
    with pytest.raises(ChannelError, match="PERMISSION_DENIED.*wrong session secret"):
        worker(agent, "coop-b", Recorder(), secret="guessed").connect()
    with pytest.raises(ChannelError, match="PERMISSION_DENIED.*no live session"):
        worker(agent, "coop-nobody", Recorder()).connect()


async def test_a_job_cannot_have_another_jobs_cooperative_process_paused(client, keys, agents):
    """Mallory registers the victim's pid as her cooperative worker: the channel says the pid is
    the victim's, so Mallory's snapshot fails and the victim is never asked anything."""
    agent = agents()
    await session(client, keys, "victim")
    await session(client, keys, "mallory", "mallory-secret")
    rec = Recorder()
    w = worker(agent, "victim", rec).start()
    try:
        await register(client, keys, "mallory", w.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "mallory", R.SNAPSHOT, token=9)
        st = await answered(client, keys, NODE, "mallory", rev)
        assert st.outcome != R.OK and rec.calls == []
    finally:
        w.close()


DYING = """
import os, sys
from timeslice.cooperative import CallbackMemory, CooperativeWorker
w = CooperativeWorker(sys.argv[1], sys.argv[2], CallbackMemory(lambda: os._exit(3), lambda: None, 1 << 20,
                      device="sim0"), sys.argv[3], sys.argv[4]).start()
print(w.pid, flush=True)
sys.stdin.read()
"""


SAYING = """
import sys
from timeslice.cooperative import CallbackMemory, CooperativeWorker
say = lambda word: print(word, flush=True)
w = CooperativeWorker(sys.argv[1], sys.argv[2], CallbackMemory(lambda: say("paused"), lambda: say("resumed"),
                      3 << 20, device="sim0", tag="weights"), sys.argv[3], sys.argv[4]).start()
say(w.pid)
sys.stdin.read()
"""


class ChildWorker:
    """A cooperative worker in a child process running ``script`` (argv: job secret node socket),
    which prints its pid, then what it does, on its stdout."""

    def __init__(self, job: str, secret: str, socket: str, script: str):
        self.p = subprocess.Popen([sys.executable, "-c", script, job, secret, NODE, socket],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)

    async def said(self, word: str, timeout: float = 30.0) -> str:
        """Read lines until ``word`` (the client library logs to stdout too); the lines read."""
        lines: list[str] = []

        async def read() -> None:
            while not lines or lines[-1].strip() != word:
                line = await asyncio.to_thread(self.p.stdout.readline)
                assert line, f"the worker exited before saying {word!r}: {''.join(lines)[-2000:]}"
                lines.append(line)
        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"the worker did not say {word!r}: {''.join(lines)[-2000:]}") from None
        return "".join(lines)

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)


async def test_a_worker_that_dies_mid_pause_is_reported_gone(client, keys, agents):
    agent = agents()
    await session(client, keys, "coop-dies")
    w = ChildWorker("coop-dies", SECRET, agent.socket, DYING)
    try:
        await w.said(str(w.p.pid))                   # the pid the agent sees is the child's
        await register(client, keys, "coop-dies", w.p.pid, {"default": "offload"})
        rev = await intent(client, keys, NODE, "coop-dies", R.SNAPSHOT, token=11)
        st = await answered(client, keys, NODE, "coop-dies", rev, timeout=20)
        assert w.p.wait(10) == 3
        assert st.state == R.GONE and st.outcome in (R.PROCESS_GONE, R.FAILED)
    finally:
        w.kill()


async def test_oversized_and_malformed_frames_are_cut_off(agents):
    import socket
    import struct
    agent = agents()
    for payload in (struct.pack(">I", 1 << 30), struct.pack(">I", 4) + b"nope"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(agent.socket)
        s.sendall(payload)
        data = s.recv(4096)
        s.close()
        assert b"refused" in data and b"INVALID_ARGUMENT" in data
    # The agent still serves a well-formed worker afterwards.
    assert agent.alive()


async def test_an_agent_restart_while_a_worker_is_paused_forgets_nothing(client, keys, agents):
    """The worker reconnects to the new agent and says what it has paused: the job stays
    snapshotted (never reported running on released memory) and the next restore resumes it."""
    agent = agents()
    await session(client, keys, "coop-r")
    rec = Recorder()
    w = worker(agent, "coop-r", rec).start()
    try:
        await register(client, keys, "coop-r", w.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "coop-r", R.SNAPSHOT, token=21)
        assert (await answered(client, keys, NODE, "coop-r", rev)).state == R.SNAPSHOTTED
        agent.kill()
        agent2 = agents()                         # same node, state dir and socket path
        assert agent2.socket == agent.socket
        # (both agents log to one file: the reconnection is the event that carries the paused tags)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not agent2.events("channel_worker_connected", job="coop-r",
                                                                  paused=["weights"]):
            await agent_refresh_pause()
        assert agent2.events("channel_worker_connected", job="coop-r", paused=["weights"])
        assert (await status(client, keys, NODE, "coop-r")).state == R.SNAPSHOTTED
        rev = await intent(client, keys, NODE, "coop-r", R.RESTORE, token=22)
        st = await answered(client, keys, NODE, "coop-r", rev, timeout=20)
        assert (st.outcome, st.state) == (R.OK, R.RUNNING) and rec.calls == ["pause", "resume"]
    finally:
        w.close()


async def test_a_long_parked_job_is_said_once(client, keys, agents):
    agent = agents(extra=["--parked-warn-s", "0.5", "--refresh-interval", "0.2"])
    await session(client, keys, "coop-p")
    w = worker(agent, "coop-p", Recorder()).start()
    try:
        await register(client, keys, "coop-p", w.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "coop-p", R.SNAPSHOT, token=31)
        await answered(client, keys, NODE, "coop-p", rev)
        [ev] = agent.wait_events("job_parked_long", 1, timeout=10, job="coop-p")
        assert ev["parked_s"] >= 0 and "must not touch the GPU" in ev["hint"]
        await agent_refresh_pause()
        await agent_refresh_pause()
        assert len(agent.events("job_parked_long", job="coop-p")) == 1     # once per parking
    finally:
        w.close()


async def test_full_isolation_also_checkpoints_what_the_pause_leaves(client, keys, agents, sim_dir):
    """isolation=full: after the cooperative pause, the checkpoint backend takes the rest (here the
    SIMULATED context arena), so nothing of the parked job stays on the device; a restore undoes both."""
    from timeslice.sim.coop import SimCooperativeMemory
    agent = agents()
    await session(client, keys, "coop-full")
    mem = SimCooperativeMemory({"weights": (3 * MiB, "offload")}, sim_dir, gbps=0)
    w = CooperativeWorker("coop-full", SECRET, mem, NODE, agent.socket).start()
    dev = SimDevice(sim_dir)
    try:
        await register(client, keys, "coop-full", w.pid, {"weights": "offload"})
        assert dev.held(w.pid) == 4 * MiB                    # context (1 MiB) + weights
        val = R.IntentValue(R.SNAPSHOT, "coop-full", "g", 41, 1, R.now_ms(), isolation=R.ISOLATION_FULL)
        rev = await put(client, keys.intent(NODE, "coop-full"), val.dump())
        st = await answered(client, keys, NODE, "coop-full", rev)
        assert (st.outcome, st.state) == (R.OK, R.SNAPSHOTTED)
        assert dev.held(w.pid) == 0 and dev.read_state(w.pid)["state"] == "checkpointed"
        assert st.bytes == 4 * MiB                           # 3 MiB paused + the 1 MiB context checkpointed
        val = R.IntentValue(R.RESTORE, "coop-full", "g", 42, 1, R.now_ms(), isolation=R.ISOLATION_FULL)
        rev = await put(client, keys.intent(NODE, "coop-full"), val.dump())
        st = await answered(client, keys, NODE, "coop-full", rev)
        assert (st.outcome, st.state) == (R.OK, R.RUNNING) and dev.held(w.pid) == 4 * MiB
        assert mem.checksum("weights") == mem.expected("weights")
    finally:
        w.close()
        mem.close()




@pytest.fixture
async def inproc_agent(client, keys, etcd, sim_dir, tmp_path):
    """An agent in this test's process (its mirrors can be stopped to make them lag etcd)."""
    from timeslice.common.server.etcd.client import EtcdConfig
    from timeslice.nodeagent.agent import Agent
    from timeslice.nodeagent.config import AgentConfig
    (tmp_path / "state").mkdir()
    cfg = AgentConfig(node=NODE, etcd=EtcdConfig(endpoints=tuple(etcd.endpoints_str.split(","))),
                      prefix=keys.prefix, listen="127.0.0.1:0", metrics_port=-1, backend="sim",
                      state_dir=str(tmp_path / "state"), sim_dir=str(sim_dir), sim_checkpoint_gbps=0,
                      sim_restore_gbps=0, channel_socket=str(tmp_path / "agent.sock"))
    agent = Agent(cfg)
    await agent.start()
    yield agent
    await agent.stop(grace=5)


async def test_a_registration_the_agents_mirror_has_not_seen_is_still_swapped_cooperatively(
        client, keys, inproc_agent):
    """The op path reads a job's registrations fresh from etcd; each pid's swapper must come from
    that same read, not from the agent's jobs mirror, which may lag it. CI once saw the lag: the
    agent took the cooperative worker for a plain process without a device context and answered
    "nothing to snapshot: the job is running already", its memory still on the device. The lag is
    made certain here: the in-process agent's jobs mirror is stopped once it has the session."""
    await session(client, keys, "coop-lag")
    w = ChildWorker("coop-lag", SECRET, inproc_agent.cfg.channel_socket, SAYING)
    try:
        await w.said(str(w.p.pid))
        await inproc_agent.jobs_mirror.stop()            # from here on it sees no new registration
        await register(client, keys, "coop-lag", w.p.pid, {"weights": "offload"})
        rev = await intent(client, keys, NODE, "coop-lag", R.SNAPSHOT, token=50)
        st = await answered(client, keys, NODE, "coop-lag", rev)
        assert (st.outcome, st.state, st.bytes) == (R.OK, R.SNAPSHOTTED, 3 * MiB), st
        await w.said("paused")
        rev = await intent(client, keys, NODE, "coop-lag", R.RESTORE, token=51)
        st = await answered(client, keys, NODE, "coop-lag", rev)
        assert (st.outcome, st.state, st.bytes) == (R.OK, R.RUNNING, 3 * MiB), st
        await w.said("resumed")
    finally:
        w.kill()


async def test_a_job_restarted_under_its_id_is_let_in_before_the_agents_mirror_sees_its_new_session(
        client, keys, inproc_agent):
    """A job restarts under the same id: a new session, a new secret. Its worker may reach the
    agent before the agent's jobs mirror has the new session key; the mirror's digest (the old
    session's) must not turn it away as "wrong session secret" (the restarted job would fail to
    start), and the old secret must not be let in once etcd holds the new one."""
    await session(client, keys, "coop-re", "the-first-run")
    first = ChildWorker("coop-re", "the-first-run", inproc_agent.cfg.channel_socket, SAYING)
    try:
        await first.said(str(first.p.pid))
    finally:
        first.kill()
    await inproc_agent.jobs_mirror.stop()                # it keeps the first run's session digest
    await session(client, keys, "coop-re", "the-second-run")
    second = ChildWorker("coop-re", "the-second-run", inproc_agent.cfg.channel_socket, SAYING)
    stale = ChildWorker("coop-re", "the-first-run", inproc_agent.cfg.channel_socket, SAYING)
    try:
        await second.said(str(second.p.pid))
        out = await asyncio.to_thread(stale.p.communicate, timeout=30)
        assert stale.p.returncode != 0 and "wrong session secret" in out[0], out
    finally:
        second.kill()
        stale.kill()
