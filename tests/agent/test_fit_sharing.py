"""A group with sharing "fit", end to end: real lockd, this node's agent, jobs whose workers hold real
bytes on a SIMULATED device that fits two of them at once. Grants overlap exactly where the declared
footprints fit; what does not fit waits and is swapped in as in an exclusive group; a phase that asks
for the GPU alone is alone; the grants are judged by the chaos checker's fit rules."""
from __future__ import annotations

import asyncio
import time

from agenthelpers import NODE, MiB, wait_agent

from chaos_tests.checker import check
from chaos_tests.holders import check_backfills_spare_the_head, check_grants_in_revision_order, etcd_history
from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.common.server.etcd import ops
from timeslice.proto import lockd_pb2 as lpb

CAP = 12 * MiB          # the device: two 4 MiB jobs at once, not three (by the footprint rule)
JOB = 4 * MiB
SLOT = f"{NODE}/0"
# What a 4 MiB declaration weighs on a first hold by the footprint rule (context, margin, spare).
WEIGHS = FP.admitted(FP.footprint({0}, hint=JOB, capacity={0: CAP}), 0)
assert 2 * WEIGHS <= CAP < 3 * WEIGHS


class Jobs:
    """Raw jobs on one replica, every step written down as the chaos checker reads it."""

    def __init__(self, stub, client, keys, workers):
        self.stub, self.client, self.keys, self.workers = stub, client, keys, workers
        self.secret: dict[str, str] = {}
        self.events: list[dict] = []
        self.w: dict = {}

    def ev(self, kind: str, job: str, **f) -> None:
        self.events.append({"ev": kind, "t": time.monotonic_ns(), "job": job, "group": "g", **f})

    async def open(self, *jobs: str) -> None:
        for j in jobs:
            self.secret[j] = (await self.stub.OpenSession(lpb.OpenSessionRequest(job_id=j, ttl_seconds=60))
                              ).session_secret

    def acquire(self, job: str, hint: int = JOB, exclusive: bool = False) -> asyncio.Future:
        self.ev("acquire_req", job)

        async def go():
            r = await self.stub.Acquire(lpb.AcquireRequest(job_id=job, session_secret=self.secret[job], group_id="g",
                                                           device_bytes_hint=hint, exclusive=exclusive), timeout=60)
            self.ev("granted", job, token=r.token, footprint=dict(r.footprint_bytes), exclusive=r.exclusive,
                    backfilled=r.backfilled)
            self.ev("cs_start", job, token=r.token)
            return r
        return asyncio.ensure_future(go())

    async def worker(self, job: str, seed: int) -> None:
        """The job's memory, made inside its first hold (as a job allocates) and registered."""
        self.w[job] = self.workers(JOB, seed=seed)
        await self.stub.RegisterWorker(lpb.WorkerRequest(job_id=job, session_secret=self.secret[job], node=NODE,
                                                         pid=self.w[job].pid, device_bytes=JOB, gpus=[0]))
        await wait_agent(self.client, self.keys, NODE, lambda a: a.job_device_bytes.get(job) == JOB)

    async def yield_(self, job: str, grant) -> None:
        self.ev("cs_end", job, token=grant.token)
        await self.stub.Yield(lpb.YieldRequest(job_id=job, session_secret=self.secret[job], group_id="g",
                                               token=grant.token))
        self.ev("yield", job, token=grant.token)

    async def queued(self, job: str) -> lpb.GroupStatus:
        """Wait until lockd shows ``job`` waiting; note its entry (``enqueued``)."""
        deadline = time.monotonic() + 20
        while True:
            st = await self.stub.GetGroupStatus(lpb.GroupRef(group_id="g"))
            w = next((w for w in st.waiters if w.job_id == job), None)
            if w is not None:
                self.ev("enqueued", job, token=w.token)
                return st
            assert time.monotonic() < deadline, f"{job} never queued: {st}"
            await asyncio.sleep(0.02)


async def test_grants_overlap_exactly_where_the_footprints_fit(keys, client, workers, lockd_node):
    async with lockd_node(CAP, sharing="fit") as n:
        js = Jobs(n.stub, client, keys, workers)
        await js.open("A", "B", "C", "D")
        ga = await js.acquire("A")
        assert dict(ga.footprint_bytes) == {SLOT: WEIGHS} and not ga.exclusive
        await js.worker("A", 1)
        # B fits beside A (4 + 4 <= 10): granted at once, while A holds.
        gb = await js.acquire("B")
        assert gb.token > ga.token and dict(gb.footprint_bytes) == {SLOT: WEIGHS}
        await js.worker("B", 2)
        # etcdctl shows every holder: one grant key each under groups/g/grants/.
        held = await client.range(ops.range_req(keys.grants("g"), prefix=True))
        assert sorted(R.GrantValue.load(kv.value).job for kv in held.kvs) == ["A", "B"]
        st = await n.stub.GetGroupStatus(lpb.GroupRef(group_id="g"))
        assert st.sharing == "fit" and [h.job_id for h in st.holders] == ["A", "B"]
        assert all(dict(h.footprint_bytes) == {SLOT: WEIGHS} for h in st.holders)
        holds = {j.job_id: [(h.group_id, dict(h.footprint_bytes)) for h in j.holds]
                 for j in (await n.stub.ListJobs(lpb.ListJobsRequest())).jobs}
        assert holds["A"] == [("g", {SLOT: WEIGHS})] and holds["C"] == []
        # C does not fit beside both (12 > 10): it waits; A's yield lets it in (A, holding nothing
        # now, is parked to make the room).
        fc = js.acquire("C")
        await js.queued("C")
        await js.yield_("A", ga)
        gc = await fc
        assert gc.bytes_moved == JOB and not gc.backfilled
        await js.worker("C", 3)
        # D asks for the device alone: it waits for both holders, then holds alone.
        fd = js.acquire("D", hint=MiB, exclusive=True)
        await js.queued("D")
        await js.yield_("B", gb)
        await js.yield_("C", gc)
        gd = await fd
        assert gd.exclusive and dict(gd.footprint_bytes) == {}
        st = await n.stub.GetGroupStatus(lpb.GroupRef(group_id="g"))
        assert [(h.job_id, h.exclusive) for h in st.holders] == [("D", True)]
        # Nobody is granted beside an exclusive holder, even what would fit.
        fa = js.acquire("A", hint=MiB)
        await js.queued("A")
        await js.yield_("D", gd)
        ga2 = await fa
        assert ga2.restored and js.w["A"].verify()            # A's bytes came back intact
        await js.yield_("A", ga2)
        report = check(js.events, fit={"g": {"capacity": {SLOT: CAP}, "margin": 0}})
        assert report.ok, report.violations
        assert report.grants == 5
        # The same grants judged in etcd's own order: tokens increasing, holders within the capacity.
        history = await etcd_history(client, keys)
        assert check_grants_in_revision_order(history, keys) == [] and check_backfills_spare_the_head(history, keys) == []


async def test_a_later_job_is_backfilled_past_a_head_that_does_not_fit_and_never_delays_it(keys, client, workers,
                                                                                           lockd_node):
    big, small = 5 * MiB, 3 * MiB          # by the footprint rule: two bigs do not fit, a big and a small do
    weighs = [FP.admitted(FP.footprint({0}, hint=h, capacity={0: CAP}), 0) for h in (big, small)]
    assert 2 * weighs[0] > CAP >= weighs[0] + weighs[1]
    async with lockd_node(CAP, sharing="fit") as n:
        js = Jobs(n.stub, client, keys, workers)
        await js.open("A", "B", "C")
        ga = await js.acquire("A", hint=big)
        fb = js.acquire("B", hint=big)                        # the head: does not fit beside A
        head = (await js.queued("B")).waiters[0].token
        gc = await js.acquire("C", hint=small)                # fits beside A, and B fits beside it: backfilled
        assert gc.backfilled and not fb.done()
        st = await n.stub.GetGroupStatus(lpb.GroupRef(group_id="g"))
        assert [h.job_id for h in st.holders] == ["A", "C"] and [w.job_id for w in st.waiters] == ["B"]
        assert st.waiters[0].token > gc.token > head         # B moved above C's token, its place kept
        js.ev("enqueued", "B", token=st.waiters[0].token)
        await js.yield_("A", ga)                              # A leaves: B goes at once, beside C
        gb = await fb
        assert not gb.backfilled and gb.token > gc.token
        await js.yield_("B", gb)
        await js.yield_("C", gc)
        assert check(js.events, fit={"g": {"capacity": {SLOT: CAP}, "margin": 0}}).ok
        history = await etcd_history(client, keys)
        assert check_grants_in_revision_order(history, keys) == [] and check_backfills_spare_the_head(history, keys) == []


async def test_an_undeclared_footprint_is_never_granted_beside_another(keys, client, workers, lockd_node):
    async with lockd_node(CAP, sharing="fit") as n:
        js = Jobs(n.stub, client, keys, workers)
        await js.open("A", "B")
        ga = await js.acquire("A")
        fb = js.acquire("B", hint=0)                          # 0: unknown, so it weighs the whole device
        await js.queued("B")
        await js.yield_("A", ga)
        gb = await fb
        assert gb.exclusive
        await js.yield_("B", gb)
        assert check(js.events, fit={"g": {"capacity": {SLOT: CAP}, "margin": 0}}).ok


async def test_side_by_side_and_alone_through_the_client_library(lockd_node):
    """Both faces, the context manager, the decorator and the integration's TimeSlice."""
    from timeslice import AsyncOrchestratorClient, OrchestratorClient
    from timeslice.integrations.slicing import TimeSlice

    async with lockd_node(CAP, sharing="fit") as n:
        target = n.lockd.replicas[0].target
        a = OrchestratorClient(target, job_id="lib-a")
        try:
            ga = await asyncio.to_thread(a.acquire, "g", 30, JOB)
            assert dict(ga.footprint_bytes) == {SLOT: WEIGHS}
            async with AsyncOrchestratorClient(target, job_id="lib-b") as b, \
                    AsyncOrchestratorClient(target, job_id="lib-c") as c:
                seen = []

                @c.on_accelerators("g", timeout=30, device_bytes_hint=MiB, exclusive=True)
                async def measure():
                    seen.append([h.job_id for h in (await c.status("g")).holders])

                async with b.on_accelerators("g", timeout=30, device_bytes_hint=JOB) as gb:   # beside a, at once
                    assert dict(gb.footprint_bytes) == {SLOT: WEIGHS} and gb.token > ga.token
                    t = asyncio.create_task(measure())
                    while not (await c.status("g")).waiters:
                        await asyncio.sleep(0.02)
                    await asyncio.to_thread(a.release, "g")
                await t                                     # c ran once b yielded too: alone
            assert seen == [["lib-c"]]
            ts = TimeSlice(a, "g", swap="none", device_bytes_hint=JOB, exclusive=True)
            with ts.hold() as g1:
                assert g1.exclusive
            with ts.hold(exclusive=False) as g2:
                assert not g2.exclusive and dict(g2.footprint_bytes)[SLOT] >= JOB
        finally:
            a.close()
