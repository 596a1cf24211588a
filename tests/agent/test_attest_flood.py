"""A legitimate worker attests while another local process floods the agent's channel socket.

A flood of silent connections can fill the socket's listen backlog for as long as the agent does
not accept them (here: the agent is stopped with SIGSTOP while the flood fills it, then let go).
A Unix socket with a full backlog answers ``connect()`` with EAGAIN at once; before, the library's
attestation (``register_worker``'s, with attestation required as ``timeslice up`` runs the agent)
gave up after 2 s with ``BlockingIOError: [Errno 11]``, the registration went on unattested and
the agent never acted on (nor counted) the worker. Now the connect is retried with jittered
backoff, bounded (``timeslice.common.channel.CONNECT_TIMEOUT_S``), and reported if it gives up.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from agenthelpers import NODE, MiB, wait_agent
from jobhelpers import CkptProc

from timeslice.common import channel as C
from timeslice.testing.procs import track, untrack

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
FOOT = 4 * MiB
STOPPED_S = 5.0              # the agent accepts nothing this long: longer than the old 2 s connect

pytestmark = pytest.mark.timeout(180)


def _flooder(sock: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "channel_flood.py"), sock, "4000"],
                         stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
    track(p)
    return p


def _said(p: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        assert line, f"process {p.pid} exited ({p.poll()})"
        if line.startswith(prefix):
            return line
    raise AssertionError(f"never said {prefix!r}")


async def test_an_attestation_waits_out_a_full_backlog(keys, client, lockd_node, sim_dir):
    async with lockd_node(64 * MiB, agent_extra=["--require-attestation"]) as n:
        flood = k = None
        try:
            n.agent.pause()
            flood = _flooder(n.agent.socket)
            said = _said(flood, "FLOODING")                    # 4000 connects tried: the backlog is full
            # EAGAIN, as a worker's connect finds it now: tried again for the time given, then reported
            # (before: BlockingIOError at once).
            t0 = time.monotonic()
            with pytest.raises(OSError) as got:
                C.connect(n.agent.socket, 0.5).close()
            assert type(got.value).__name__ == "BacklogFull" and time.monotonic() - t0 >= 0.5, \
                f"the connect gave up at once on a full backlog: {got.value!r}"
            assert "stayed full" in str(got.value) and "gave up after" in str(got.value), got.value
            k = CkptProc(n.lockd.replicas[0].target, "ckpt-k", sim_dir, FOOT,
                         env={"TIMESLICE_AGENT_SOCKET": n.agent.socket})
            k.send(f"acquire g {FOOT}")                        # granted; then it registers (and attests)
            time.sleep(STOPPED_S)
            n.agent.resume()
            g = k._read(90)
            assert g["ok"] and g["alloc"] == "ok", g
            # The agent acts on the worker (attestation required): it counts its memory as the job's.
            await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("ckpt-k") == FOOT, timeout=30)
            assert n.agent.events("channel_worker_connected", pid=k.pid), said
            assert not n.agent.events("worker_not_attested", pid=k.pid)
        finally:
            n.agent.resume()
            for p in (flood, k.p if k else None):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
            if flood is not None:
                untrack(flood.pid)
