"""The sync client against real lockd replicas: decorator, context manager,
aliases, constructor spellings, hooks, workers, admin calls and error mapping."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.client.helpers import FakeCuda, fake_torch, wait_for
from timeslice import (
    AcquireTimeoutError,
    GroupBusyError,
    InvalidArgumentError,
    NotHolderError,
    OrchestratorClient,
    StaleTokenError,
    TimeSliceOrchestratorClient,
    UnknownGroupError,
)
from timeslice.errors import AlreadyExistsError, ClientClosedError


def test_acquire_yield_and_the_grant(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"j-{uid}", session_ttl=3))
    grant = c.acquire(group, timeout=10)
    assert grant.group_id == group and grant.job_id == f"j-{uid}" and grant.token > 0
    assert grant.leader_epoch > 0 and grant.waited_ms >= 0 and not grant.restored
    assert c.held == {group: grant}
    assert c.acquire(group).token == grant.token            # re-acquire while holding: same grant
    time.sleep(4)                                           # longer than the TTL: keepalives hold it
    st = c.status(group)
    assert st.holder.job_id == c.job_id and st.grant.token == grant.token
    rel = c.release(group)                                  # alias of yield_
    assert rel.released and rel.deferred_snapshot and rel.token == grant.token
    assert c.held == {} and c.status(group).holder is None
    assert OrchestratorClient.release is OrchestratorClient.yield_


def test_fifo_and_tokens_across_two_clients(lockd, group, uid, clients):
    a = clients(OrchestratorClient(lockd.targets, job_id=f"a-{uid}"))
    b = clients(OrchestratorClient(list(reversed(lockd.targets)), job_id=f"b-{uid}"))
    ga = a.acquire(group)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("b", b.acquire(group, timeout=20)))
    t.start()
    wait_for(lambda: [w.job_id for w in a.status(group).waiters] == [b.job_id], what="b queued")
    assert "b" not in got
    a.yield_(group)
    t.join(10)
    assert got["b"].token > ga.token and got["b"].waited_ms > 0
    b.yield_(group)


def test_decorator_on_sync_and_async_functions_and_context_manager(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"d-{uid}"))
    seen = []

    @c.on_accelerators(group_id=group)
    def phase(x):
        seen.append(("sync", c.held[group].token))
        return x * 2

    @c.on_accelerators(group_id=group)
    async def aphase(x):
        await asyncio.sleep(0)
        seen.append(("async", c.held[group].token))
        return x + 1

    assert phase.__name__ == "phase" and asyncio.iscoroutinefunction(aphase)
    assert phase(21) == 42
    assert asyncio.run(aphase(1)) == 2
    assert c.held == {}
    with c.on_accelerators(group) as grant:
        assert c.held[group] == grant
        with c.on_accelerators(group) as inner:            # nested: no second acquire, no early yield
            assert inner.token == grant.token
        assert group in c.held
        assert phase(1) == 2                                # a decorated call inside the scope
        assert group in c.held
    assert c.held == {}
    assert [k for k, _ in seen] == ["sync", "async", "sync"]
    assert seen[0][1] < seen[1][1]                          # a fresh grant per call

    async def main():
        async with c.on_accelerators(group) as g:
            return g
    assert asyncio.run(main()).group_id == group
    assert c.held == {}


def test_exception_in_body_still_yields(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"e-{uid}"))

    @c.on_accelerators(group_id=group)
    def boom():
        raise RuntimeError("oops")

    with pytest.raises(RuntimeError):
        boom()
    assert c.held == {} and c.status(group).holder is None


def test_hooks_run_around_the_hold(lockd, group, uid, clients, monkeypatch):
    calls = []
    fake_torch(monkeypatch, FakeCuda(calls.append))
    c = clients(OrchestratorClient(lockd.targets, job_id=f"h-{uid}",
                                   after_acquire=lambda g: calls.append(("after_acquire", g.token)),
                                   before_yield=lambda g: calls.append(("before_yield", g.token))))
    with c.on_accelerators(group) as grant:
        calls.append("body")
    assert calls == [("after_acquire", grant.token), "body", ("before_yield", grant.token),
                     "synchronize", "empty_cache"]
    calls.clear()
    off = clients(OrchestratorClient(lockd.targets, job_id=f"h2-{uid}", release_cache=False))
    with off.on_accelerators(group):
        pass
    assert calls == []


def test_constructor_spellings_take_the_environment(lockd, group, uid, clients, monkeypatch):
    monkeypatch.setenv("TIMESLICE_JOB_ID", f"env-job-{uid}")
    c = clients(TimeSliceOrchestratorClient(target=",".join(lockd.targets)))
    assert c.job_id == f"env-job-{uid}" and isinstance(c, OrchestratorClient)
    assert c.acquire(group).job_id == f"env-job-{uid}"
    c.yield_(group)

    monkeypatch.delenv("TIMESLICE_JOB_ID")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    gen = clients(TimeSliceOrchestratorClient(target=lockd.targets[0]))
    assert gen.config.job_id_generated and gen.job_id
    assert gen.acquire(group).job_id == gen.job_id
    gen.yield_(group)

    monkeypatch.setenv("TIMESLICE_TARGET", ",".join(lockd.targets))
    o = clients(OrchestratorClient(job_id=f"o-{uid}"))
    assert o.targets == tuple(lockd.targets)
    assert o.acquire(group).job_id == f"o-{uid}"
    o.yield_(group)


def test_error_mapping(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"err-{uid}"))
    with pytest.raises(UnknownGroupError, match="unknown group"):
        c.acquire(f"nope-{uid}", timeout=5)
    with pytest.raises(InvalidArgumentError):
        c.acquire("bad/group", timeout=5)
    with pytest.raises(InvalidArgumentError):
        c.status("x" * 200)
    with pytest.raises(InvalidArgumentError):
        OrchestratorClient(lockd.targets, job_id="bad job")
    with pytest.raises(NotHolderError):                      # nothing acquired in this client
        c.yield_(group)
    with pytest.raises(NotHolderError) as ei:                # lockd's answer for a token never held
        c.yield_(group, token=10**12)
    assert ei.value.code == "FAILED_PRECONDITION" and ei.value.reason == "not_queued"
    grant = c.acquire(group)
    with pytest.raises(StaleTokenError):
        c.yield_(group, token=grant.token - 1)
    c.yield_(group)
    with pytest.raises(NotHolderError):                      # twice
        c.yield_(group, token=grant.token)
    assert c.status(group).holder is None                    # bad input changed nothing


def test_yield_by_a_waiter_is_not_holder(lockd, group, uid, clients):
    a = clients(OrchestratorClient(lockd.targets, job_id=f"wa-{uid}"))
    b = clients(OrchestratorClient(lockd.targets, job_id=f"wb-{uid}"))
    a.acquire(group)
    threading.Thread(target=lambda: b.acquire(group, timeout=15), daemon=True).start()
    wait_for(lambda: a.status(group).waiters, what="b queued")
    token = a.status(group).waiters[0].token
    with pytest.raises(NotHolderError) as ei:
        b.yield_(group, token=token)
    assert ei.value.reason == "not_holder"
    a.yield_(group)


def test_acquire_timeout_gives_up_the_place(lockd, group, uid, clients):
    a = clients(OrchestratorClient(lockd.targets, job_id=f"ta-{uid}"))
    b = clients(OrchestratorClient(lockd.targets, job_id=f"tb-{uid}"))
    a.acquire(group)
    with pytest.raises(AcquireTimeoutError, match="timeout|within"):
        b.acquire(group, timeout=0.5)
    st = a.status(group)
    assert st.holder.job_id == a.job_id and st.waiters == ()
    a.yield_(group)


def test_workers_groups_and_jobs(lockd, uid, clients, monkeypatch):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"w-{uid}"))
    monkeypatch.setenv("TIMESLICE_NODE_NAME", f"node-{uid}")
    w = c.register_worker(device_bytes=1 << 20)
    assert w.node == f"node-{uid}" and w.pid > 0
    c.register_worker(pid=4_000_000, node="other-node")       # (pid 1 is init: refused)
    jobs = {j.job_id: j for j in c.jobs()}
    assert jobs[c.job_id].workers == 2 and jobs[c.job_id].lease_id == c.lease_id
    c.unregister_worker(pid=4_000_000, node="other-node")
    wait_for(lambda: {j.job_id: j for j in c.jobs()}[c.job_id].workers == 1, what="worker gone")

    g = f"adm-{uid}"
    created = c.create_group(g, ["n1:0,1", ("n2", [])])
    assert [str(n) for n in created.nodes] == ["n1:0,1", "n2"]
    assert c.create_group(g, ["n1:0,1", "n2"]) == created        # same nodes again: a no-op
    with pytest.raises(AlreadyExistsError):
        c.create_group(g, ["n3"])
    wait_for(lambda: g in [x.group_id for x in c.groups()], what="group listed")
    other = clients(OrchestratorClient(lockd.targets, job_id=f"w2-{uid}"))
    other.acquire(g)
    with pytest.raises(GroupBusyError):
        c.delete_group(g)
    assert c.delete_group(g, force=True) is True
    with pytest.raises(UnknownGroupError):
        c.delete_group(g)


def test_watch_yields_on_every_change(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"wt-{uid}"))
    seen = []
    ready = threading.Event()

    def watcher():
        for st in c.watch(group, timeout=20):
            seen.append(st)
            ready.set()
            if len(seen) == 3:
                return
    t = threading.Thread(target=watcher)
    t.start()
    assert ready.wait(10)
    assert seen[0].holder is None
    grant = c.acquire(group)
    wait_for(lambda: any(s.grant and s.grant.token == grant.token for s in seen), what="grant seen")
    c.yield_(group)
    t.join(10)
    assert not t.is_alive()
    assert seen[-1].holder is None


def test_close_is_idempotent_and_final(lockd, group, uid):
    c = OrchestratorClient(lockd.targets, job_id=f"cl-{uid}")
    with c:
        c.acquire(group)
    c.close()
    with pytest.raises(ClientClosedError):
        c.acquire(group)
    admin = OrchestratorClient(lockd.targets, job_id=f"cl2-{uid}")
    try:
        assert admin.status(group).holder is None            # closing released the hold
        assert f"cl-{uid}" not in [j.job_id for j in admin.jobs()]
    finally:
        admin.close()
