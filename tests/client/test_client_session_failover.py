"""Session loss is surfaced (typed error + callback, once); failover while
blocked in Acquire keeps the job's place."""
from __future__ import annotations

import threading
import time

import pytest

from tests.client.helpers import wait_for
from timeslice import OrchestratorClient, SessionLostError


def test_session_loss_is_surfaced_once(etcd, lockd, group, uid, clients):
    fired = []
    c = clients(OrchestratorClient(lockd.targets, job_id=f"lost-{uid}", session_ttl=3,
                                   on_session_lost=fired.append))
    grant = c.acquire(group)
    assert not c.session_lost
    etcd.revoke_lease(c.lease_id)            # as an expiry would: the queue entry and grant go too
    with pytest.raises(SessionLostError):
        c.yield_(group, token=grant.token)
    assert c.session_lost and c.held == {}
    with pytest.raises(SessionLostError):    # every later session call too
        c.acquire(group)
    assert len(fired) == 1 and isinstance(fired[0], SessionLostError)
    assert c.status(group).holder is None    # admin calls still work
    c.reset_session()                        # explicit: a fresh session, a fresh place in line
    assert not c.session_lost
    assert c.acquire(group).token > grant.token
    c.yield_(group)
    assert len(fired) == 1


def test_session_loss_noticed_by_keepalive_and_decorator(etcd, lockd, group, uid, clients):
    fired = threading.Event()
    c = clients(OrchestratorClient(lockd.targets, job_id=f"ka-{uid}", session_ttl=3,
                                   on_session_lost=lambda e: fired.set()))

    @c.on_accelerators(group_id=group)
    def phase():
        etcd.revoke_lease(c.lease_id)
        assert fired.wait(10)                # the keepalive thread noticed, while we "computed"
        return "done"

    with pytest.raises(SessionLostError):    # ...and leaving the scope says so
        phase()
    assert c.session_lost


def test_session_loss_while_blocked_in_acquire(etcd, lockd, group, uid, clients):
    a = clients(OrchestratorClient(lockd.targets, job_id=f"la-{uid}"))
    b = clients(OrchestratorClient(lockd.targets, job_id=f"lb-{uid}"))
    a.acquire(group)
    b.open_session()
    out = {}

    def wait():
        try:
            b.acquire(group, timeout=30)
        except Exception as e:
            out["err"] = e
    t = threading.Thread(target=wait)
    t.start()
    wait_for(lambda: a.status(group).waiters, what="b queued")
    etcd.revoke_lease(b.lease_id)
    t.join(15)
    assert isinstance(out.get("err"), SessionLostError)
    a.yield_(group)


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_failover_while_blocked_in_acquire(etcd, lockd_own, uid, victim):
    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    if victim == "leader":
        kill = leader
    else:
        kill = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not kill]
    holder = OrchestratorClient(survivors, job_id=f"holder-{uid}")
    waiter = OrchestratorClient([kill.target] + survivors, job_id=f"waiter-{uid}")
    try:
        g = f"fo-{uid}"
        holder.create_group(g, ["node-x"])
        holder.acquire(g)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("grant", waiter.acquire(g, timeout=60)))
        t.start()
        wait_for(lambda: holder.status(g).waiters, what="waiter queued")
        queued_token = holder.status(g).waiters[0].token
        assert waiter.target == kill.target
        kill.kill()                                       # SIGKILL the replica the waiter is blocked on
        wait_for(lambda: waiter.target != kill.target, what="waiter failed over")
        assert t.is_alive()                               # still waiting: the holder has not yielded
        holder.yield_(g)
        t.join(30)
        assert out["grant"].token == queued_token         # the same queue entry: its place was kept
        assert waiter.held[g].token == queued_token
        waiter.yield_(g)
    finally:
        holder.close()
        waiter.close()


def test_paused_replica_under_a_blocked_acquire_is_left(etcd, lockd_own, uid):
    """SIGSTOP the waiter's replica: no socket closes, so only the session's keepalive
    notices; the blocked acquire(timeout=None) is re-sent to another replica."""
    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    victim = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not victim]
    holder = OrchestratorClient(survivors, job_id=f"holder-{uid}")
    waiter = OrchestratorClient([victim.target] + survivors, job_id=f"waiter-{uid}", session_ttl=3)
    try:
        g = f"pause-{uid}"
        holder.create_group(g, ["node-x"])
        holder.acquire(g)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("grant", waiter.acquire(g)))
        t.start()
        wait_for(lambda: holder.status(g).waiters, what="waiter queued")
        queued_token = holder.status(g).waiters[0].token
        victim.pause()
        try:
            wait_for(lambda: waiter.target != victim.target, timeout=15, what="keepalive failover")
            holder.yield_(g)
            t.join(20)
            assert out["grant"].token == queued_token
            assert not waiter.session_lost
        finally:
            victim.resume()
        time.sleep(0.5)                 # the resumed replica answers its left-behind call...
        assert holder.status(g).grant.token == queued_token   # ...without releasing the hold
        waiter.yield_(g)
    finally:
        holder.close()
        waiter.close()
