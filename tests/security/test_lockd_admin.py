"""Admin calls and group deletion, replayed against real lockd processes."""
from __future__ import annotations

import asyncio

import grpc

from tests.security.conftest import NODE, MiB, etcd_state, rpc_error
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.proto import nodeagent_pb2 as npb
from timeslice.proto import nodeagent_pb2_grpc as npbg
from timeslice.testing.lockd import LockdProcess, admin_channel


async def test_group_calls_need_the_admin_token(stack, etcd_client, admin, jobs):
    await admin.CreateGroup(lpb.CreateGroupRequest(group_id="adm-g", nodes=[lpb.NodeSpec(node="n1")]), timeout=10)
    mallory = await jobs("mallory")            # a job with a valid session is no admin
    before = await etcd_state(etcd_client, stack.keys, "adm-g", "adm-h", mallory.job_id)
    e = await rpc_error(mallory.stub.DeleteGroup(lpb.DeleteGroupRequest(group_id="adm-g", force=True), timeout=10))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    e = await rpc_error(mallory.stub.CreateGroup(lpb.CreateGroupRequest(group_id="adm-h"), timeout=10))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    async with admin_channel(stack.target, token="wrong-token-" + "y" * 20) as ch:
        e = await rpc_error(lpbg.LockdStub(ch).DeleteGroup(lpb.DeleteGroupRequest(group_id="adm-g", force=True),
                                                           timeout=10))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    assert await etcd_state(etcd_client, stack.keys, "adm-g", "adm-h", mallory.job_id) == before
    assert (await admin.DeleteGroup(lpb.DeleteGroupRequest(group_id="adm-g"), timeout=10)).deleted


async def _own_lockd(stack, tmp_path, rid: str, env: dict, extra: list[str]) -> LockdProcess:
    p = LockdProcess(stack.etcd_endpoints, stack.prefix, rid, str(tmp_path), extra)
    p.env.update(env)
    await asyncio.to_thread(p.start)
    return p


async def test_without_a_token_admin_calls_are_off_unless_explicitly_opened(stack, etcd_client, tmp_path):
    off = await _own_lockd(stack, tmp_path, "notoken", {"TIMESLICE_ADMIN_TOKEN": ""}, [])
    try:
        before = await etcd_state(etcd_client, stack.keys, "off-g")
        async with admin_channel(off.target) as ch:        # even with the (unknown to it) token
            e = await rpc_error(lpbg.LockdStub(ch).CreateGroup(lpb.CreateGroupRequest(group_id="off-g"),
                                                               timeout=10))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
        assert await etcd_state(etcd_client, stack.keys, "off-g") == before
    finally:
        off.stop()
    opened = await _own_lockd(stack, tmp_path, "insecure", {"TIMESLICE_ADMIN_TOKEN": ""},
                              ["--insecure-no-admin-auth"])
    try:
        async with grpc.aio.insecure_channel(opened.target) as ch:
            g = await lpbg.LockdStub(ch).CreateGroup(lpb.CreateGroupRequest(group_id="open-g"), timeout=10)
            assert g.group_id == "open-g"
            await lpbg.LockdStub(ch).DeleteGroup(lpb.DeleteGroupRequest(group_id="open-g"), timeout=10)
    finally:
        opened.stop()


async def test_groups_are_bounded_in_number(stack, etcd_client, tmp_path):
    small = await _own_lockd(stack, tmp_path, "fewgroups", {}, ["--max-groups", "2"])
    try:
        async with admin_channel(small.target) as ch:
            stub = lpbg.LockdStub(ch)
            st = await stub.ListGroups(lpb.ListGroupsRequest(), timeout=10)
            for i in range(2 - len(st.groups)):
                await stub.CreateGroup(lpb.CreateGroupRequest(group_id=f"few-{i}"), timeout=10)
            while len((await stub.ListGroups(lpb.ListGroupsRequest(), timeout=10)).groups) < 2:
                await asyncio.sleep(0.05)              # the replica's mirror catches up
            before = await etcd_state(etcd_client, stack.keys, "few-0", "few-1", "few-x")
            e = await rpc_error(stub.CreateGroup(lpb.CreateGroupRequest(group_id="few-x"), timeout=10))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_groups" in e.details(), e
            assert await etcd_state(etcd_client, stack.keys, "few-0", "few-1", "few-x") == before
            for i in range(2):
                try:
                    await stub.DeleteGroup(lpb.DeleteGroupRequest(group_id=f"few-{i}"), timeout=10)
                except grpc.aio.AioRpcError:
                    pass
    finally:
        small.stop()


async def _wait(pred, what: str, timeout: float = 30.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await pred()
        if got:
            return got
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def test_deleting_a_held_group_tells_the_holder_and_fences_its_token(stack, etcd_client, admin, jobs,
                                                                        workers):
    a, b = await jobs("holder"), await jobs("next")
    wa, wb = workers(40 * MiB, seed=7), workers(8 * MiB, seed=8)
    await a.register(NODE, wa.pid, 40 * MiB)
    await b.register(NODE, wb.pid, 8 * MiB)
    await admin.CreateGroup(lpb.CreateGroupRequest(group_id="del-g", nodes=[lpb.NodeSpec(node=NODE)]), timeout=10)
    ga = await a.acquire("del-g", hint=40 * MiB)
    c = await jobs("waiter")
    waiting = asyncio.ensure_future(c.acquire("del-g"))

    async def c_queued():
        st = await admin.GetGroupStatus(lpb.GroupRef(group_id="del-g"), timeout=10)
        return [w.job_id for w in st.waiters] == [c.job_id]
    await _wait(c_queued, "the waiter is queued")
    # An admin deletes the group under A's hold and makes it again; B is granted it.
    assert (await admin.DeleteGroup(lpb.DeleteGroupRequest(group_id="del-g", force=True), timeout=10)).deleted
    e = await rpc_error(waiting)                          # the waiting call is told at once, not left hanging
    assert e.code() == grpc.StatusCode.NOT_FOUND and "del-g" in e.details(), e
    await admin.CreateGroup(lpb.CreateGroupRequest(group_id="del-g", nodes=[lpb.NodeSpec(node=NODE)]), timeout=10)
    gb = await b.acquire("del-g", hint=30 * MiB)       # 30 MiB do not fit beside A's 40 on 64
    assert gb.token > ga.token and not gb.elided          # A's process was moved out for B
    # A hears of it on its keepalive, in the middle of its GPU phase ...
    ka = await a.stub.KeepAlive(lpb.SessionRef(job_id=a.job_id, session_secret=a.secret), timeout=10)
    assert list(ka.revoked_groups) == ["del-g"]
    # ... and its next call on the group says the group was deleted under its hold (not a plain "not queued").
    e = await rpc_error(a.yield_("del-g", ga.token))
    assert e.code() == grpc.StatusCode.ABORTED and "group_deleted" in e.details(), e
    e = await rpc_error(a.yield_("del-g", ga.token))      # told once; then the ordinary answer
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
    ka = await a.stub.KeepAlive(lpb.SessionRef(job_id=a.job_id, session_secret=a.secret), timeout=10)
    assert list(ka.revoked_groups) == []
    # A stale order carrying A's old token (a deposed leader's) is refused by the agent.
    ikey, skey = stack.keys.intent(NODE, a.job_id), stack.keys.status(NODE, a.job_id)
    stale = R.IntentValue(R.RESTORE, a.job_id, "del-g", ga.token, ga.leader_epoch, R.now_ms())
    await etcd_client.txn([], [ops.put(ikey, stale.dump())])

    async def refused():
        r = await etcd_client.range(ops.range_req(skey))
        return r.kvs and "stale_token" in R.StatusValue.load(r.kvs[0].value).error
    await _wait(refused, "the agent refuses the old token")
    async with admin_channel(stack.agent.target) as ch:
        st = await npbg.NodeAgentStub(ch).Status(npb.AgentStatusRequest(), timeout=10)
    states = {p.pid: p.state for p in st.processes}
    assert states[wa.pid] == "checkpointed" and states[wb.pid] == "running"
    assert wb.verify(timeout=10)
    await b.yield_("del-g", gb.token)
