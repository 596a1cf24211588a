"""A job's next Acquire right after its Yield joins at the back (priority and fit groups: entries
carry their arrival, ``since``). The Yield's delete may not be in the serving replica's mirror yet;
the arrival was taken from the mirror, so the job took its old entry's arrival and went ahead of a
job that had queued meanwhile (the fit chaos scenarios caught it: fifo-fit). The mirror's lag is
made certain here: the old entry is put back into the in-process replica's index."""
from __future__ import annotations

import asyncio

from tests.lockd.gated import replica_in_process, until


async def test_the_next_acquire_after_a_yield_does_not_take_the_old_entrys_arrival(etcd, key_prefix):
    async with replica_in_process(etcd.endpoints_str, key_prefix) as rep:
        await rep.groups.create("g", [], priorities=(True, 4, 0))
        await until(lambda: "g" in rep.index.groups and rep.leader.scheduler is not None, what="group and leader")
        lease = {j: (await rep.sessions.open(j, 30))[1] for j in "ABD"}
        queue = rep.index.groups["g"].queue

        def acquire(job: str, seq: int):
            return asyncio.ensure_future(rep.locks.acquire(job, lease[job], "g", 0, 30, seq=seq))

        a = await acquire("A", 1)
        fb = acquire("B", 1)
        await until(lambda: "B" in queue, what="B queued")
        stale = queue["A"]
        await rep.locks.yield_("A", "g", a.token)
        b = await fb
        fd = acquire("D", 1)                          # D queues while B holds ...
        await until(lambda: "D" in queue and "A" not in queue, what="D queued, A's entry gone")
        queue["A"] = stale                            # ... and the mirror has not shown A's delete yet
        fa = acquire("A", 2)                          # A asks again, after D
        await until(lambda: "A" in queue and queue["A"].create_revision > queue["D"].create_revision,
                    what="A queued again")
        await rep.locks.yield_("B", "g", b.token)
        done, _ = await asyncio.wait({fa, fd}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert done == {fd}, "A went ahead of D, who had queued before A asked again"
        await rep.locks.yield_("D", "g", fd.result().token)
        assert (await asyncio.wait_for(fa, 20)).token > fd.result().token
