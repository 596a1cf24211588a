"""What a cooperative pause leaves on the device (the residue: a CUDA context, allocator blocks outside
the regions) is planned for: when it is what keeps the next job from fitting, it goes by the
checkpoint full isolation uses, for that swap only, and comes back before its job's next grant.

End to end on one SIMULATED GPU of 32 MiB: real etcd, one lockd replica, the node agent, a cooperative
job in its own process (1 MiB context + 12 MiB offloaded + 7 MiB discarded regions) and a checkpoint
job that needs 31.5 MiB, which fits only once the cooperative job's context is off the device too.
"""
from __future__ import annotations

from agenthelpers import NODE, MiB, status, wait_agent
from jobhelpers import CkptJob, Job

from timeslice.common.server import records as R

COOP = f"weights:{12 * MiB}:offload,kv:{7 * MiB}:discard"
FOOT = 20 * MiB                 # the cooperative job on the device: 1 MiB context + both regions
BIG = 31 * MiB + MiB // 2       # more than the GPU less the cooperative job's context


async def test_a_residue_in_the_next_jobs_way_is_checkpointed_and_comes_back(keys, client, lockd_node, workers,
                                                                              sim_dir):
    async with lockd_node(32 * MiB) as n:
        c = Job(n.lockd.replicas[0].target, "coop-c", sim_dir, n.agent.socket, COOP)
        try:
            assert c(f"acquire g {FOOT}")["ok"] and c("write weights 0badcafe")["ok"]
            assert c("yield g")["deferred"]
            await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("coop-c") == FOOT)
            b = await CkptJob(n.stub, "ckpt-b").open()
            gb = await b.acquire(BIG)
            st = await status(client, keys, NODE, "coop-c")
            assert st.state == R.SNAPSHOTTED and st.residue_bytes == 0, st     # its context went too
            await b.register(workers(BIG, seed=2), BIG)    # fits: before, this allocation ran out of memory
            # The grant counts both snapshots of C in this swap: the pause's 12 MiB and the context's 1 MiB.
            assert gb.bytes_moved == 12 * MiB + MiB, gb
            await b.yield_()
            g = await c.ask(f"acquire g {FOOT}")
            assert g["ok"] and g["restored"], g
            assert c("verify weights")["match"] and c("verify kv")["match"]
            assert c("yield g")["ok"]
        finally:
            c.kill()
