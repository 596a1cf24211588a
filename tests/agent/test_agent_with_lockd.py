"""End to end: real lockd + this agent + two jobs whose workers hold real bytes on a
SIMULATED device too small for both, so every handover needs a swap through etcd."""
from __future__ import annotations

from agenthelpers import NODE, MiB, status, wait_agent

from timeslice.common.server import records as R
from timeslice.proto import lockd_pb2 as lpb

JOB = 6 * MiB          # each job; the device has 10 MiB: one job at a time


async def test_handover_swaps_jobs_through_the_agent(keys, client, workers, lockd_node):
    async with lockd_node(10 * MiB, group="trainer") as n:
        stub, agent = n.stub, n.agent
        secret = {}
        for job in ("job-a", "job-b"):
            secret[job] = (await stub.OpenSession(lpb.OpenSessionRequest(job_id=job, ttl_seconds=60))
                           ).session_secret

        async def register(job, w):
            await stub.RegisterWorker(lpb.WorkerRequest(job_id=job, session_secret=secret[job], node=NODE,
                                                        pid=w.pid, device_bytes=JOB))
            # The leader decides elision from the agent key: wait until it shows the job.
            await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get(job) == JOB)

        async def acquire(job):
            return await stub.Acquire(lpb.AcquireRequest(job_id=job, session_secret=secret[job],
                                                         group_id="trainer", device_bytes_hint=JOB),
                                      timeout=30)

        async def yield_(job, grant):
            return await stub.Yield(lpb.YieldRequest(job_id=job, session_secret=secret[job],
                                                     group_id="trainer", token=grant.token))

        wa = workers(JOB, seed=1)
        await register("job-a", wa)
        ga = await acquire("job-a")
        assert (ga.restored, ga.bytes_moved) == (False, 0)
        assert (await yield_("job-a", ga)).deferred_snapshot        # nobody waits: A stays resident

        # B needs the room A holds: the leader has the agent snapshot A.
        gb = await acquire("job-b")
        assert (gb.restored, gb.bytes_moved) == (False, JOB) and gb.token > ga.token
        st = await status(client, keys, NODE, "job-a")
        assert (st.state, st.outcome, st.token, st.device_bytes) == (R.SNAPSHOTTED, R.OK, gb.token, JOB)
        wb = workers(JOB, seed=2)                                  # fits only now
        await register("job-b", wb)
        await yield_("job-b", gb)

        # A again: B goes out, A comes back, with its bytes intact.
        ga2 = await acquire("job-a")
        assert ga2.restored and ga2.bytes_moved == 2 * JOB and ga2.token > gb.token
        assert wa.verify()
        await yield_("job-a", ga2)

        gb2 = await acquire("job-b")
        assert gb2.restored and gb2.bytes_moved == 2 * JOB and gb2.token > ga2.token
        assert wb.verify()
        await yield_("job-b", gb2)

        done = agent.wait_events("op_done", 5)
        assert [(e["job"], e["op"]) for e in done] == [
            ("job-a", "snapshot"), ("job-b", "snapshot"), ("job-a", "restore"),
            ("job-a", "snapshot"), ("job-b", "restore")]
        assert all(e["outcome"] == "ok" and e["written"] for e in done)
        for job in ("job-a", "job-b"):
            await stub.CloseSession(lpb.SessionRef(job_id=job, session_secret=secret[job]))
