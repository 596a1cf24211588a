"""Exclusion enforced at the device: a holder whose session lease expires while its
process lives on the GPU (paused past its lease: a GC pause, SIGSTOP, a frozen VM) is frozen by the
node agent *before* the leader grants past it, even when the next job fits beside it (an elided
handoff, where nothing else would stop the stale holder's kernels). Its job registering it again
(a new session) thaws it. Real lockd, agent and SIMULATED-device worker processes.
"""
from __future__ import annotations

import pytest
from agenthelpers import NODE, MiB, wait_agent

from timeslice.proto import lockd_pb2 as lpb

JOB = 3 * MiB          # both fit on the 10 MiB device: the handoff is elided


async def test_a_holder_that_lost_its_lease_is_frozen_before_the_next_grant(etcd, keys, client, workers, lockd_node):
    async with lockd_node(10 * MiB) as n:
        stub, agent, lockd, dev = n.stub, n.agent, n.lockd, n.dev
        sess = {}
        for job in ("holder", "next"):
            sess[job] = await stub.OpenSession(lpb.OpenSessionRequest(job_id=job, ttl_seconds=60))
        wh = workers(JOB, seed=3)
        await stub.RegisterWorker(lpb.WorkerRequest(job_id="holder", session_secret=sess["holder"].session_secret,
                                                    node=NODE, pid=wh.pid, device_bytes=JOB))
        await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("holder") == JOB)
        g1 = await stub.Acquire(lpb.AcquireRequest(job_id="holder", session_secret=sess["holder"].session_secret,
                                                   group_id="g", device_bytes_hint=JOB), timeout=30)
        assert g1.token > 0
        # The holder's lease expires while it holds (as after a pause past its TTL).
        etcd.revoke_lease(sess["holder"].lease_id)
        g2 = await stub.Acquire(lpb.AcquireRequest(job_id="next", session_secret=sess["next"].session_secret,
                                                   group_id="g", device_bytes_hint=JOB), timeout=30)
        assert g2.bytes_moved == 0 and g2.token > g1.token   # both fit: nothing else stops the holder
        # By the time "next" was granted, the stale holder's process could run nothing on the device.
        agent.wait_events("orphan_frozen", 1, job="holder", pid=wh.pid)
        assert dev.read_state(wh.pid)["state"] == "locked"
        assert agent.events("orphan_frozen")[0]["timestamp"] <= _grant_time(lockd)
        with pytest.raises(TimeoutError):
            wh.ask("verify", timeout=0.5)      # a device operation of the stale holder waits
        # Its job comes back (a new session re-registers the worker): thawed, bytes intact.
        s2 = await stub.OpenSession(lpb.OpenSessionRequest(job_id="holder", ttl_seconds=60))
        await stub.RegisterWorker(lpb.WorkerRequest(job_id="holder", session_secret=s2.session_secret,
                                                    node=NODE, pid=wh.pid, device_bytes=JOB))
        agent.wait_events("orphan_thawed", 1, job="holder", pid=wh.pid)
        assert wh.read(10) == f"VERIFY OK {wh.expected}"     # the waiting call ran, bytes intact


def _grant_time(lockd) -> str:
    """When the leader wrote the grant to "next" (its structured log)."""
    evs = [e for r in lockd.replicas for e in r.events("grant") if e.get("job") == "next"]
    return min(e["timestamp"] for e in evs) if evs else "9999"
