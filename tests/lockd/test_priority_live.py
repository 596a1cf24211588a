"""Priority classes against real etcd and real lockd replicas: served by class, FIFO within a class,
the aging bounds, tokens increasing in grant order, FIFO groups untouched, bad input refused,
and a leader failover mid-queue. The grants are also judged by the chaos checker's rules."""
import asyncio
import time

import grpc
import pytest

from chaos_tests.checker import check
from tests.lockd.conftest import Job, admin
from timeslice.common.server import records as R
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.keys import Keys
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg


async def make_group(target, group="g", **prio):
    ch, stub = await admin(target)
    await stub.CreateGroup(pb.CreateGroupRequest(group_id=group, **prio))
    return ch, stub


async def wait_status(stub, ok, what, group="g", target_stub=None):
    deadline = time.monotonic() + 20
    while True:
        st = await (target_stub or stub).GetGroupStatus(pb.GroupRef(group_id=group), timeout=5)
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"never saw {what}: {st}"
        await asyncio.sleep(0.02)


class Run:
    """Jobs over the replicas; every Acquire's request, entry and grant written down as the chaos
    checker reads them (history.py's events)."""

    def __init__(self, targets, stub):
        self.targets, self.stub, self.events, self.jobs = targets, stub, [], {}

    async def job(self, name, i):
        self.jobs[name] = await Job(self.targets[i % len(self.targets)], name).open()
        return self.jobs[name]

    def ev(self, kind, job, **f):
        self.events.append({"ev": kind, "t": time.monotonic_ns(), "job": job, "group": "g", **f})

    async def queue(self, name, cls, n_before):
        """Start ``name``'s Acquire and wait until lockd shows it queued (n_before waited or held before)."""
        self.ev("acquire_req", name, priority=cls)
        fut = asyncio.ensure_future(self.jobs[name].acquire("g", priority=cls))
        st = await wait_status(self.stub, lambda s: any(w.job_id == name for w in s.waiters), f"{name} queued")
        self.ev("enqueued", name, token=next(w.token for w in st.waiters if w.job_id == name))
        return fut

    async def serve(self, holder, token, pending):
        """Yield, then let each granted job hold and yield in turn; returns the grant order and tokens."""
        order, tokens = [], [token]
        while True:
            await self.jobs[holder].yield_("g", token)
            self.ev("yield", holder, token=token)
            if not pending:
                return order, tokens
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "one grant per yield"
            rep = done.pop().result()
            pending = [f for f in pending if not f.done()]
            self.ev("granted", rep.job_id, token=rep.token)
            order.append(rep.job_id)
            tokens.append(rep.token)
            holder, token = rep.job_id, rep.token

    async def close(self):
        for j in self.jobs.values():
            await j.close()


async def test_served_by_class_fifo_within_class_tokens_increase(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0], priorities=True, max_overtakes=8)
    run = Run(t, stub)
    for i, name in enumerate(["A", "L1", "L2", "H1", "H2"]):
        await run.job(name, i)
    run.ev("acquire_req", "A")
    a = await run.jobs["A"].acquire("g")
    run.ev("granted", "A", token=a.token)
    pending = [await run.queue("L1", 0, 1), await run.queue("L2", 0, 2),
               await run.queue("H1", 5, 3), await run.queue("H2", 5, 4)]
    st = await wait_status(stub, lambda s: len(s.waiters) == 4, "4 waiters")
    assert [(w.job_id, w.priority) for w in st.waiters] == [("H1", 5), ("H2", 5), ("L1", 0), ("L2", 0)]
    assert st.priorities and st.max_overtakes == 8
    order, tokens = await run.serve("A", a.token, pending)
    assert order == ["H1", "H2", "L1", "L2"]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), f"tokens not increasing: {tokens}"
    report = check(run.events, priorities={"g": 8})
    assert report.ok, report.violations
    assert check(run.events).of_kind("fifo"), "judged as a FIFO group, this order is a violation"
    await run.close()
    await ch.close()


async def test_aging_by_grants_bounds_the_overtaking(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0], priorities=True, max_overtakes=2)
    run = Run(t, stub)
    for i, name in enumerate(["A", "L", "H1", "H2", "H3", "H4"]):
        await run.job(name, i)
    run.ev("acquire_req", "A")
    a = await run.jobs["A"].acquire("g")
    run.ev("granted", "A", token=a.token)
    # L's replica must see A's grant (and its count) before L joins: L's age counts from there.
    _, l_stub = await admin(run.jobs["L"].target)
    await wait_status(stub, lambda s: s.grant.job_id == "A", "A's grant on L's replica", target_stub=l_stub)
    pending = [await run.queue("L", 0, 1)]
    for i, h in enumerate(["H1", "H2", "H3", "H4"]):
        pending.append(await run.queue(h, 5, 2 + i))
    order, tokens = await run.serve("A", a.token, pending)
    assert order == ["H1", "H2", "L", "H3", "H4"], "L goes first once 2 grants were made since it joined"
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), f"tokens not increasing: {tokens}"
    report = check(run.events, priorities={"g": 2})
    assert report.ok, report.violations
    assert check(run.events, priorities={"g": 1}).of_kind("overtake")
    await run.close()
    await ch.close()


async def test_aging_by_wait_time(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0], priorities=True, max_overtakes=1000, max_wait_s=1)
    run = Run(t, stub)
    for i, name in enumerate(["A", "L", "H1", "H2"]):
        await run.job(name, i)
    a = await run.jobs["A"].acquire("g")
    pending = [await run.queue("L", 0, 1)]
    joined = time.monotonic()
    pending += [await run.queue("H1", 5, 2), await run.queue("H2", 5, 3)]
    await asyncio.sleep(max(0.0, joined + 1.3 - time.monotonic()))     # L has waited past max_wait_s
    order, tokens = await run.serve("A", a.token, pending)
    assert order == ["L", "H1", "H2"]
    assert tokens == sorted(tokens)
    await run.close()
    await ch.close()


async def test_fifo_group_stays_strict_and_writes_what_it_wrote(lockd3, etcd):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    run = Run(t, stub)
    for i, name in enumerate(["A", "B", "C"]):
        await run.job(name, i)
    a = await run.jobs["A"].acquire("g")
    pending = [await run.queue("B", 0, 1), await run.queue("C", 0, 2)]
    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    r = await c.range(ops.range_req(keys.group("g"), prefix=True))
    for kv in r.kvs:
        assert b"priorit" not in kv.value and b"since" not in kv.value and b"max_" not in kv.value, kv
    assert not any(kv.key == keys.turns("g") for kv in r.kvs)
    order, tokens = await run.serve("A", a.token, pending)
    assert order == ["B", "C"] and tokens == sorted(tokens)
    assert not (await c.range(ops.range_req(keys.turns("g")))).kvs, "a FIFO group has no turns key"
    await run.close()
    await ch.close()


async def test_bad_priorities_are_refused_and_change_nothing(lockd3, etcd):
    t = lockd3.targets
    ch, stub = await admin(t[0])
    for bad in [dict(max_overtakes=3), dict(max_wait_s=5), dict(priorities=True, max_overtakes=1001),
                dict(priorities=True, max_wait_s=7 * 24 * 3600 + 1)]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.CreateGroup(pb.CreateGroupRequest(group_id="bad", **bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert not [g for g in (await stub.ListGroups(pb.ListGroupsRequest())).groups if g.group_id == "bad"]
    await stub.CreateGroup(pb.CreateGroupRequest(group_id="fifo"))
    await stub.CreateGroup(pb.CreateGroupRequest(group_id="prio", priorities=True))
    # The same group again with other priorities is another group: refused.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.CreateGroup(pb.CreateGroupRequest(group_id="prio", priorities=True, max_overtakes=9))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    j = await Job(t[1], "j").open()
    for group, cls in [("fifo", 1), ("prio", 10), ("prio", 2**32 - 1)]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await j.acquire(group, priority=cls, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (group, cls)
        assert "priority" in e.value.details()
    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    for group in ("fifo", "prio"):
        assert not (await c.range(ops.range_req(keys.queue(group), prefix=True))).kvs, "nothing queued"
    g = await j.acquire("prio", priority=9, timeout=10)
    assert g.token > 0
    await j.close()
    await ch.close()


async def test_leader_failover_mid_queue_keeps_the_order(lockd3, etcd):
    leader, epoch = lockd3.leader(etcd)
    followers = [r for r in lockd3.replicas if r is not leader]
    ft = [r.target for r in followers]
    ch, stub = await make_group(ft[0], priorities=True)
    run = Run(ft, stub)
    for i, name in enumerate(["A", "L", "M", "H"]):
        await run.job(name, i)
    a = await run.jobs["A"].acquire("g")
    pending = [await run.queue("L", 0, 1), await run.queue("M", 3, 2), await run.queue("H", 7, 3)]
    leader.kill()
    order, tokens = await run.serve("A", a.token, pending)
    assert order == ["H", "M", "L"]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), f"tokens not increasing: {tokens}"
    new_leader, new_epoch = lockd3.leader(etcd, timeout=30)
    assert new_leader is not leader and new_epoch > epoch
    await run.close()
    await ch.close()


async def test_moved_waiter_cancelled_leaves_no_ghost(lockd3, etcd):
    """L is overtaken and moved under a fresh key; its Acquire follows it, and once cancelled
    removes it there: no waiter left behind, no marker either."""
    t = lockd3.targets
    ch, stub = await make_group(t[0], priorities=True)
    run = Run(t, stub)
    for i, name in enumerate(["A", "L", "H"]):
        await run.job(name, i)
    a = await run.jobs["A"].acquire("g")
    call_l = run.jobs["L"].stub.Acquire(pb.AcquireRequest(job_id="L", session_secret=run.jobs["L"].secret,
                                                          group_id="g"), timeout=60)
    st = await wait_status(stub, lambda s: [w.job_id for w in s.waiters] == ["L"], "L queued")
    first_key = st.waiters[0].token
    fut_h = await run.queue("H", 5, 2)
    await run.jobs["A"].yield_("g", a.token)
    h = await fut_h
    assert h.token > first_key
    st = await wait_status(stub, lambda s: [w.job_id for w in s.waiters] == ["L"] and s.waiters[0].token > h.token,
                           "L moved under a key above H's token")
    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    call_l.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call_l
    await wait_status(stub, lambda s: not s.waiters, "no ghost waiter")
    assert not (await c.range(ops.range_req(keys.moving("g", "L")))).kvs
    assert not (await c.range(ops.range_req(keys.queue_entry("g", "L")))).kvs
    # The group goes on: H yields, nobody is left to grant; a new waiter is granted at once.
    await run.jobs["H"].yield_("g", h.token)
    g = await run.jobs["L"].acquire("g", timeout=10)
    assert g.token > h.token
    await run.close()
    await ch.close()


async def test_waiter_cancelled_while_its_entry_is_out_leaves_nothing(lockd3, etcd):
    """The leader stops between moving L's entry out and in (played by hand while it is paused):
    L's Acquire, cancelled then, removes the marker, so no leader moves a ghost in afterwards."""
    from timeslice.lockd import rekey as RK

    leader, _ = lockd3.leader(etcd)
    followers = [r for r in lockd3.replicas if r is not leader]
    ch, stub = await make_group(followers[0].target, priorities=True)
    a = await Job(followers[0].target, "A").open()
    lj = await Job(followers[1].target, "L", ttl=30).open()     # outlives the waits below
    ga = await a.acquire("g")
    call_l = lj.stub.Acquire(pb.AcquireRequest(job_id="L", session_secret=lj.secret, group_id="g"), timeout=60)
    _, l_stub = await admin(followers[1].target)
    await wait_status(stub, lambda s: [w.job_id for w in s.waiters] == ["L"], "L queued", target_stub=l_stub)
    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    spec = (await c.range(ops.range_req(keys.spec("g")))).kvs[0]
    kv = (await c.range(ops.range_req(keys.queue_entry("g", "L")))).kvs[0]
    leader.pause()
    try:
        out = RK.MoveOut("L", kv.create_revision, kv.mod_revision, kv.lease, RK.moved_value(kv.value, kv.create_revision))
        cmp, put = RK.txn(keys, "g", out, spec.create_revision)
        assert (await c.txn(cmp, put)).succeeded
        marker = (await c.range(ops.range_req(keys.moving("g", "L")))).kvs[0]
        await wait_status(stub, lambda s: [(w.job_id, w.token) for w in s.waiters] == [("L", marker.create_revision)],
                          "L out, on L's replica", target_stub=l_stub)
        # A waiter whose entry is out still counts: the group is busy (A's entry aside, too).
        await a.yield_("g", ga.token)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.DeleteGroup(pb.DeleteGroupRequest(group_id="g"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "1 queued" in e.value.details()
        call_l.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call_l
        deadline = time.monotonic() + 10
        # Neither the marker nor an entry moved in from it (a new leader may be elected meanwhile).
        while (await c.range(ops.range_req(keys.moving("g", "L")))).kvs or \
                (await c.range(ops.range_req(keys.queue_entry("g", "L")))).kvs:
            assert time.monotonic() < deadline, "the cancelled waiter's entry stayed (marker, or moved in)"
            await asyncio.sleep(0.02)
    finally:
        leader.resume()
    b = await Job(followers[0].target, "B").open()
    gb = await b.acquire("g", timeout=20)          # granted: no ghost L moved in ahead of it
    assert gb.token > ga.token
    assert not (await c.range(ops.range_req(keys.queue_entry("g", "L")))).kvs
    # Deleted under its holder, the notices name who held it (the grant, not the oldest key).
    await stub.DeleteGroup(pb.DeleteGroupRequest(group_id="g", force=True))
    note = R.RevokedValue.load((await c.range(ops.range_req(keys.revoked("B", "g")))).kvs[0].value)
    assert note.held and note.token == gb.token
    await a.close(), await lj.close(), await b.close(), await ch.close()


async def test_resent_acquire_keeps_the_arrival_of_a_moved_entry(lockd3):
    """L1 and L2 (class 0) are overtaken and moved; L1's client re-sends its Acquire to another
    replica, which takes the entry over: L1 keeps its arrival, so it still goes before L2."""
    t = lockd3.targets
    ch, stub = await make_group(t[0], priorities=True)
    run = Run(t, stub)
    for i, name in enumerate(["A", "L1", "L2", "H"]):
        await run.job(name, i)
    a = await run.jobs["A"].acquire("g")
    l1 = run.jobs["L1"]

    channels = []

    def send(target, seq):
        channels.append(grpc.aio.insecure_channel(target))
        return pbg.LockdStub(channels[-1]).Acquire(
            pb.AcquireRequest(job_id="L1", session_secret=l1.secret, group_id="g", attempt_seq=seq), timeout=60)
    first = send(t[1], 1)
    await wait_status(stub, lambda s: [w.job_id for w in s.waiters] == ["L1"], "L1 queued")
    f2 = await run.queue("L2", 0, 2)
    fh = await run.queue("H", 5, 3)
    await run.jobs["A"].yield_("g", a.token)
    h = await fh
    await wait_status(stub, lambda s: all(w.token > h.token for w in s.waiters) and len(s.waiters) == 2,
                      "L1 and L2 moved above H's token")
    again = asyncio.ensure_future(send(t[2], 2))      # the client's re-send, on another replica
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await first                             # superseded by the re-send
    assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
    await run.jobs["H"].yield_("g", h.token)
    done, _ = await asyncio.wait([again, f2], return_when=asyncio.FIRST_COMPLETED)
    assert done == {again}, "L1 arrived first: it goes before L2"
    g1 = again.result()
    await l1.yield_("g", g1.token)
    g2 = await f2
    assert h.token < g1.token < g2.token
    await run.close()
    for c in channels:
        await c.close()
    await ch.close()
