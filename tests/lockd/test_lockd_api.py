"""lockd with 3 real replicas against real etcd: order, re-acquire, cancellation,
lease expiry, followers, leader failover, fencing, and bad input."""
import asyncio
import time

import grpc
import pytest

from tests.lockd.conftest import Job, admin
from timeslice.common.server import records as R
from timeslice.proto import lockd_pb2 as pb


async def make_group(target, group="g", nodes=()):
    ch, stub = await admin(target)
    await stub.CreateGroup(pb.CreateGroupRequest(group_id=group, nodes=[pb.NodeSpec(node=n) for n in nodes]))
    return ch, stub


async def status(stub, group="g"):
    return await stub.GetGroupStatus(pb.GroupRef(group_id=group), timeout=5)


async def wait_queued(stub, n, group="g"):
    deadline = time.monotonic() + 20
    while True:
        st = await status(stub, group)
        if (1 if st.holder.job_id else 0) + len(st.waiters) >= n:
            return st
        assert time.monotonic() < deadline, f"never saw {n} queued: {st}"
        await asyncio.sleep(0.05)


async def test_fifo_order_across_replicas_and_holder_reacquire(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    jobs = [await Job(t[i % 3], f"job{i}").open() for i in range(6)]
    first = await jobs[0].acquire("g")
    again = await jobs[0].acquire("g")
    assert again.token == first.token, "the holder's re-acquire returns its grant at once"
    pending = []
    for j in jobs[1:]:
        pending.append(asyncio.ensure_future(j.acquire("g")))
        await wait_queued(stub, len(pending) + 1)
    st = await status(stub)
    assert [w.job_id for w in st.waiters] == [f"job{i}" for i in range(1, 6)]
    order, holder, tok = [], jobs[0], first.token
    for _ in range(5):
        await holder.yield_("g", tok)
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "exactly one waiter is granted per yield"
        fut = done.pop()
        pending.remove(fut)
        rep = fut.result()
        assert rep.token > tok
        order.append(rep.job_id)
        holder, tok = next(j for j in jobs if j.job_id == rep.job_id), rep.token
    assert order == [f"job{i}" for i in range(1, 6)]
    for j in jobs:
        await j.close()
    await ch.close()


async def test_cancelled_and_timed_out_acquire_leave_no_ghost(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    a, b, c = [await Job(t[i], n).open() for i, n in enumerate("abc")]
    ga = await a.acquire("g")
    call = b.stub.Acquire(pb.AcquireRequest(job_id="b", session_secret=b.secret, group_id="g"), timeout=30)
    await wait_queued(stub, 2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await c.acquire("g", timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while (st := await status(stub)).waiters:
        assert time.monotonic() < deadline, f"ghost waiters left: {st.waiters}"
        await asyncio.sleep(0.05)
    assert st.holder.job_id == "a" and st.grant.token == ga.token
    y = await a.yield_("g", ga.token)
    assert y.released and y.deferred_snapshot, "nobody waits: the job stays resident"
    for j in (a, b, c):
        await j.close()
    await ch.close()


async def test_dead_clients_lease_releases_the_group(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    dead = await Job(t[1], "dead", ttl=3).open()       # never sends KeepAlive
    live = await Job(t[2], "live").open()
    gd = await dead.acquire("g")
    t0 = time.monotonic()
    gl = await live.acquire("g", timeout=30)
    assert gl.token > gd.token and time.monotonic() - t0 >= 1.0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dead.keepalive()
    assert e.value.code() == grpc.StatusCode.ABORTED, "a lost session is reported as such"
    await dead.close(), await live.close(), await ch.close()


async def test_keepalive_keeps_session(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    j = await Job(t[1], "kept", ttl=3).open()
    g = await j.acquire("g")
    for _ in range(8):
        assert await j.keepalive() > 0
        await asyncio.sleep(0.5)
    st = await status(stub)
    assert st.grant.job_id == "kept" and st.grant.token == g.token
    await j.close(), await ch.close()


async def test_bad_input_gets_clear_status_and_changes_nothing(lockd3):
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    a, b = await Job(t[0], "a").open(), await Job(t[1], "b").open()
    ga = await a.acquire("g")
    before = await status(stub)

    async def code_of(coro):
        try:
            await coro
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return None, ""

    bad_ids = ["", "x" * 128, "a/b", "../x", "-lead", "sp ace", "ünï"]
    for bad in bad_ids:
        code, _ = await code_of(stub.OpenSession(pb.OpenSessionRequest(job_id=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        code, _ = await code_of(stub.CreateGroup(pb.CreateGroupRequest(group_id=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        code, _ = await code_of(a.stub.Acquire(pb.AcquireRequest(job_id="a", session_secret=a.secret,
                                                                group_id=bad), timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
    code, msg = await code_of(a.acquire("nosuch", timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "nosuch" in msg
    code, msg = await code_of(b.yield_("g", ga.token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not_queued" in msg
    code, msg = await code_of(a.yield_("g", ga.token - 1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale_token" in msg
    code, msg = await code_of(a.stub.Yield(pb.YieldRequest(job_id="a", session_secret=b.secret,
                                                           group_id="g", token=ga.token)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, msg = await code_of(a.stub.Yield(pb.YieldRequest(job_id="a", session_secret="", group_id="g",
                                                           token=ga.token)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, msg = await code_of(stub.OpenSession(pb.OpenSessionRequest(job_id="a")))
    assert code == grpc.StatusCode.ALREADY_EXISTS, "nobody can take over a live job's session"
    code, msg = await code_of(a.yield_("g", 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, msg = await code_of(stub.DeleteGroup(pb.DeleteGroupRequest(group_id="g")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # A waiter that yields is not a holder.
    wb = asyncio.ensure_future(b.acquire("g"))
    st = await wait_queued(stub, 2)
    code, msg = await code_of(b.yield_("g", st.waiters[0].token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not_holder" in msg
    after = await status(stub)
    assert after.grant == before.grant and after.holder == before.holder
    await a.yield_("g", ga.token)
    assert (await wb).job_id == "b"
    for j in (a, b):
        await j.close()
    await ch.close()


async def test_follower_serves_and_leader_kill_keeps_lock(lockd3, etcd):
    leader, epoch = lockd3.leader(etcd)
    followers = [r for r in lockd3.replicas if r is not leader]
    ch, stub = await make_group(followers[0].target)
    a = await Job(followers[0].target, "a").open()
    b = await Job(followers[1].target, "b").open()
    ga = await a.acquire("g")
    assert ga.leader_epoch == epoch
    wb = asyncio.ensure_future(b.acquire("g", timeout=60))
    await wait_queued(stub, 2)
    leader.kill()
    await a.yield_("g", ga.token)
    gb = await wb
    # Handed over directly (fenced by the dead leader's still-valid epoch) or by the
    # next leader: either way in order, and the cluster elects a new leader.
    assert gb.token > ga.token and gb.leader_epoch >= epoch
    new_leader, new_epoch = lockd3.leader(etcd, timeout=30)
    assert new_leader is not leader and new_epoch > epoch
    await b.yield_("g", gb.token)
    c = await Job(followers[1].target, "c").open()
    wc = asyncio.ensure_future(c.acquire("g", timeout=60))
    gc = await wc
    assert gc.token > gb.token
    await a.close(), await b.close(), await c.close(), await ch.close()


async def test_paused_leader_cannot_grant_after_waking(lockd3, etcd):
    """Ping-pong while the leader is SIGSTOPped past its lease: grants keep FIFO and fencing."""
    leader, epoch = lockd3.leader(etcd)
    followers = [r for r in lockd3.replicas if r is not leader]
    ch, stub = await make_group(followers[0].target)
    jobs = [await Job(followers[i % 2].target, f"p{i}").open() for i in range(2)]
    grants = []
    stop = asyncio.Event()

    async def loop(job):
        while not stop.is_set():
            g = await job.acquire("g", timeout=60)
            grants.append((g.token, g.leader_epoch, job.job_id))
            await asyncio.sleep(0.01)
            await job.yield_("g", g.token)
            await job.keepalive()

    tasks = [asyncio.ensure_future(loop(j)) for j in jobs]
    await asyncio.sleep(1)
    leader.pause()
    await asyncio.sleep(6)           # > lease ttl (3 s): another replica leads
    leader.resume()
    await asyncio.sleep(2)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    tokens = [t for t, _, _ in grants]
    epochs = [e for _, e, _ in grants]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert epochs == sorted(epochs), "a grant from an old epoch came after a newer leader's grant"
    assert max(epochs) > epoch and any(e == epoch for e in epochs)
    for j in jobs:
        await j.close()
    await ch.close()


async def test_leader_killed_mid_swap_new_leader_finishes(lockd3, etcd):
    """Play the node agent by hand: the swap started by one leader completes under the next."""
    from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
    from timeslice.common.server.keys import Keys

    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    agent_lease, _ = await c.grant_lease(30)
    await c.txn([], [ops.put(keys.agent("n1"), R.AgentValue("n1", "hand", device_total_bytes=100,
                                                             device_free_bytes=10).dump(), agent_lease)])
    leader, epoch = lockd3.leader(etcd)
    followers = [r for r in lockd3.replicas if r is not leader]
    ch, stub = await make_group(followers[0].target, nodes=["n1"])
    a = await Job(followers[0].target, "a").open()
    b = await Job(followers[1].target, "b").open()
    for j, pid in ((a, 111), (b, 222)):
        await j.stub.RegisterWorker(pb.WorkerRequest(job_id=j.job_id, session_secret=j.secret, node="n1",
                                                     pid=pid, device_bytes=80))
    ga = await a.acquire("g")
    wb = asyncio.ensure_future(b.acquire("g", timeout=60, hint=80))
    await wait_queued(stub, 2)
    await a.yield_("g", ga.token)
    # The leader asks for a snapshot of a (b needs 80, only 10 free).
    deadline = time.monotonic() + 20
    while not (r := await c.range(ops.range_req(keys.intent("n1", "a")))).kvs:
        assert time.monotonic() < deadline, "no snapshot intent"
        await asyncio.sleep(0.05)
    intent_kv = r.kvs[0]
    it = R.IntentValue.load(intent_kv.value)
    assert it.op == R.SNAPSHOT and it.leader_epoch == epoch
    leader.kill()
    assert not wb.done()
    st = R.StatusValue(R.SNAPSHOTTED, "a", op=R.SNAPSHOT, outcome=R.OK, intent_revision=intent_kv.mod_revision,
                       token=it.token, bytes=80, device_bytes=80)
    resp = await c.txn([ops.mod_rev(keys.intent("n1", "a"), "==", intent_kv.mod_revision)],
                       [ops.put(keys.status("n1", "a"), st.dump()),
                        ops.put(keys.agent("n1"), R.AgentValue("n1", "hand", device_total_bytes=100,
                                                               device_free_bytes=90).dump(), agent_lease)])
    assert resp.succeeded
    gb = await wb
    assert gb.leader_epoch > epoch and not gb.restored and gb.bytes_moved == 80
    await a.close(), await b.close(), await ch.close(), await c.close()


async def test_resent_acquire_takes_over_and_old_call_cannot_release(lockd3):
    """A client fails over and re-sends Acquire; the first call, ended late, must not free the hold."""
    t = lockd3.targets
    ch, stub = await make_group(t[0])
    x = await Job(t[0], "x").open()
    gx = await x.acquire("g")
    j1 = await Job(t[1], "j").open()
    j2 = Job(t[2], "j")
    j2.secret, j2.lease = j1.secret, j1.lease          # the same job, talking to another replica
    first = j1.stub.Acquire(pb.AcquireRequest(job_id="j", session_secret=j1.secret, group_id="g"), timeout=60)
    st = await wait_queued(stub, 2)
    token = st.waiters[0].token
    second = asyncio.ensure_future(j2.acquire("g", timeout=60))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await first
    assert e.value.code() == grpc.StatusCode.CANCELLED and "newer Acquire" in e.value.details()
    st = await status(stub)
    assert [w.token for w in st.waiters] == [token], "the entry keeps its place and token"
    await x.yield_("g", gx.token)
    gj = await second
    assert gj.token == token
    y = await Job(t[0], "y").open()
    wy = asyncio.ensure_future(y.acquire("g", timeout=60))
    await wait_queued(stub, 2)
    await asyncio.sleep(0.3)
    st = await status(stub)
    assert st.grant.job_id == "j" and st.grant.token == token and not wy.done()
    await j2.yield_("g", token)
    assert (await wy).job_id == "y"
    for job in (x, j1, j2, y):
        await job.close()
    await ch.close()


async def test_yield_on_the_leader_hands_over_in_one_transaction(lockd3, etcd):
    leader, epoch = lockd3.leader(etcd)
    follower = next(r for r in lockd3.replicas if r is not leader)
    ch, stub = await make_group(leader.target)
    a = await Job(leader.target, "a").open()
    b = await Job(follower.target, "b").open()
    ga = await a.acquire("g")
    wb = asyncio.ensure_future(b.acquire("g"))
    await wait_queued(stub, 2)
    deadline = time.monotonic() + 10
    while not any(ev["token"] == ga.token for ev in leader.events("grant")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)           # the leader's mirror has seen a's grant
    y = await a.yield_("g", ga.token)
    gb = await wb
    assert y.released and not y.deferred_snapshot and gb.leader_epoch == epoch
    grants = {ev["token"]: ev for ev in leader.events("grant")}
    assert grants[gb.token]["direct"] is True and grants[gb.token]["job"] == "b"
    st = await status(stub)
    assert st.grant.job_id == "b" and st.grant.token == gb.token and not st.waiters
    await b.yield_("g", gb.token)
    await a.close(), await b.close(), await ch.close()


@pytest.mark.slow
async def test_leader_forgets_departed_jobs_intents_and_empty_statuses(lockd3, etcd):
    from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
    from timeslice.common.server.keys import Keys

    keys = Keys(lockd3.prefix)
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    put = await c.txn([], [ops.put(keys.intent("n1", "ghost"), R.IntentValue(R.SNAPSHOT, "ghost", "g", 5, 1).dump())])
    rev = put.header.revision
    await c.txn([], [ops.put(keys.status("n1", "ghost"), R.StatusValue(
        R.RUNNING, "ghost", op=R.SNAPSHOT, outcome=R.OK, intent_revision=rev).dump()),
        ops.put(keys.status("n1", "parked"), R.StatusValue(R.SNAPSHOTTED, "parked", outcome=R.OK).dump())])
    deadline = time.monotonic() + 40
    while True:
        left = {k: bool((await c.range(ops.range_req(k))).kvs)
                for k in (keys.intent("n1", "ghost"), keys.status("n1", "ghost"))}
        if not any(left.values()):
            break
        assert time.monotonic() < deadline, f"not forgotten: {left}"
        await asyncio.sleep(0.5)
    assert (await c.range(ops.range_req(keys.status("n1", "parked")))).kvs, "a parked context's record stays"
    await c.close()
