"""The client under restarts and stalls: a job restarted under the same id
gets no false session loss; a paused replica is left as fast as a dead one; an
Acquire attempt caught by a replica stall leaves no ghost holder when it is
processed late."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.client.helpers import wait_for
from timeslice import AsyncOrchestratorClient, OrchestratorClient


def crash(c: OrchestratorClient) -> None:
    """As SIGKILL would leave it: no more keepalives, nothing closed, the lease left to expire."""
    async def stop(aio):
        aio._core.closing = True     # its later close() at teardown must not count as anything
        aio._sessions.stop_keepalive()
    c._loop.call(stop(c._aio))


@pytest.mark.slow
def test_job_restarted_under_the_same_id_keeps_its_new_session(lockd, group, uid, clients):
    """Process A holds and dies; B (same job id) waits A's session out and is granted.
    B's session was opened a whole TTL after its OpenSession began: its keepalive
    watchdog must count from the lease B got, not from when it started asking."""
    job = f"restart-{uid}"
    a = clients(OrchestratorClient(lockd.targets, job_id=job, session_ttl=6))   # B waits 4-6 s for it
    a.acquire(group)
    crash(a)
    fired = []
    b = clients(OrchestratorClient(lockd.targets, job_id=job, session_ttl=3, on_session_lost=fired.append))
    grant = b.acquire(group)                    # waits out A's lease (~3 s), then is granted
    time.sleep(3 * b.config.keepalive_period)   # three keepalive rounds of the new session
    assert fired == [] and not b.session_lost, f"false session loss: {fired}"
    assert b.status(group).holder.job_id == job
    assert b.yield_(group).released and b.held == {}
    assert grant.token > 0


def test_async_job_restarted_under_the_same_id_keeps_its_new_session(lockd, group, uid, clients):
    job = f"arestart-{uid}"
    a = clients(OrchestratorClient(lockd.targets, job_id=job, session_ttl=6))   # B waits 4-6 s for it
    a.acquire(group)
    crash(a)

    async def run():
        fired = []
        async with AsyncOrchestratorClient(lockd.targets, job_id=job, session_ttl=3,
                                           on_session_lost=fired.append) as b:
            await b.acquire(group)
            await asyncio.sleep(3 * b.config.keepalive_period)
            assert fired == [] and not b.session_lost, f"false session loss: {fired}"
            assert (await b.yield_(group)).released

    asyncio.run(run())


def test_job_restarted_while_waiting_is_granted_without_false_loss(lockd, group, uid, clients):
    """A waits (another job holds) and dies; B (same id) comes back and waits in its place."""
    holder = clients(OrchestratorClient(lockd.targets, job_id=f"rh-{uid}"))
    holder.acquire(group)
    job = f"rw-{uid}"
    a = clients(OrchestratorClient(lockd.targets, job_id=job, session_ttl=6))   # B waits 4-6 s for it
    t = threading.Thread(target=lambda: pytest.raises(Exception, a.acquire, group, 30), daemon=True)
    t.start()
    wait_for(lambda: holder.status(group).waiters, what="A queued")
    crash(a)
    fired = []
    b = clients(OrchestratorClient(lockd.targets, job_id=job, session_ttl=3, on_session_lost=fired.append))
    out = {}
    tb = threading.Thread(target=lambda: out.setdefault("g", b.acquire(group, timeout=60)), daemon=True)
    tb.start()
    wait_for(lambda: b.lease_id is not None, what="B's session")
    wait_for(lambda: any(w.job_id == job for w in holder.status(group).waiters), what="B queued")
    time.sleep(3 * b.config.keepalive_period)
    holder.yield_(group)
    tb.join(30)
    assert "g" in out and fired == [] and not b.session_lost
    b.yield_(group)


def test_paused_replica_is_left_by_keepalive_pings_not_after_the_session_keepalive(etcd, lockd_own, uid):
    """With a long session TTL (keepalive RPC every 10 s) a blocked acquire must still leave
    a SIGSTOPped replica within the ping timeout (~2 s), as after a kill."""
    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    victim = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not victim]
    holder = OrchestratorClient(survivors, job_id=f"holder-{uid}")
    waiter = OrchestratorClient([victim.target] + survivors, job_id=f"waiter-{uid}", session_ttl=30)
    try:
        g = f"ping-{uid}"
        holder.create_group(g, ["node-x"])
        holder.acquire(g)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("grant", waiter.acquire(g)), daemon=True)
        t.start()
        wait_for(lambda: holder.status(g).waiters, what="waiter queued")
        victim.pause()
        try:
            # Well before the session keepalive (every 10 s, 7.5 s attempt deadline) could notice.
            wait_for(lambda: waiter.target != victim.target, timeout=6, what="failover on ping timeout")
            holder.yield_(g)
            t.join(20)
            assert "grant" in out and not waiter.session_lost
        finally:
            victim.resume()
        waiter.yield_(g)
    finally:
        holder.close()
        waiter.close()


def test_acquire_sent_to_a_stalled_replica_leaves_no_ghost_when_it_resumes(etcd, lockd_own, uid):
    """The replica serving the first attempt is stopped before it reads it; the client
    fails over, is granted elsewhere, works, yields. When the stalled replica resumes and
    processes the first attempt, it must not enqueue (and be granted) a ghost of the job."""
    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    victim = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not victim]
    admin = OrchestratorClient(survivors, job_id=f"admin-{uid}")
    job = OrchestratorClient([victim.target] + survivors, job_id=f"ghost-{uid}", session_ttl=3)
    try:
        g = f"stall-{uid}"
        admin.create_group(g, ["node-x"])
        job.open_session()                        # its channel to the victim is up
        victim.pause()
        try:
            grant = job.acquire(g, timeout=30)    # sent to the stopped victim first, then re-sent
            assert job.target != victim.target
            job.yield_(g, grant.token)
        finally:
            victim.resume()
        # The resumed replica now reads the first attempt. Give it time to act, then look.
        wait_for(lambda: victim.alive(), what="victim alive")
        time.sleep(2.0)
        st = admin.status(g)
        assert st.holder is None and not st.waiters, f"ghost left by a stale attempt: {st}"
    finally:
        admin.close()
        job.close()


def test_acquire_that_failed_with_its_replica_gone_is_withdrawn(etcd, lockd_own, uid):
    """The only replica a waiter knows dies under its blocked acquire, which fails
    (UNAVAILABLE). The job's queue entry outlives the call; when the replica is back and
    the session renews there, the client takes the entry back, so the group is not later
    granted to nobody (a ghost holder) while the job goes on with its session."""
    from timeslice.errors import UnavailableError
    from timeslice.retry import RetryPolicy

    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    victim = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not victim]
    holder = OrchestratorClient(survivors, job_id=f"holder-{uid}")
    # A session that outlives the replica's restart on a loaded machine, and the 20 s wait below: the
    # entry can then go only by the client's withdrawal, never by the lease running out.
    waiter = OrchestratorClient([victim.target], job_id=f"gone-{uid}", session_ttl=30,
                                retry=RetryPolicy(failover_window=1.0, attempt_timeout=1.0))
    try:
        g = f"wd-{uid}"
        holder.create_group(g, ["node-x"])
        holder.acquire(g)
        out = {}

        def wait():
            try:
                waiter.acquire(g)
            except Exception as e:
                out["err"] = e
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        wait_for(lambda: holder.status(g).waiters, what="waiter queued")
        victim.kill()
        t.join(30)
        assert isinstance(out.get("err"), UnavailableError)
        assert holder.status(g).waiters, "the entry outlived the failed call (the case under test)"
        victim.extra = [*victim.extra, "--listen", victim.target]   # back on the same address
        victim.start()
        wait_for(lambda: not holder.status(g).waiters, timeout=20, what="the failed acquire withdrawn")
        holder.yield_(g)
        st = holder.status(g)
        assert st.holder is None and not st.waiters, f"ghost: {st}"
        assert not waiter.session_lost
    finally:
        holder.close()
        waiter.close()


def test_async_acquire_that_failed_with_its_replica_gone_is_withdrawn(etcd, lockd_own, uid):
    from timeslice.errors import UnavailableError
    from timeslice.retry import RetryPolicy

    cluster = lockd_own
    leader, _ = cluster.leader(etcd)
    victim = next(r for r in cluster.replicas if r is not leader)
    survivors = [r.target for r in cluster.replicas if r is not victim]
    holder = OrchestratorClient(survivors, job_id=f"aholder-{uid}")
    g = f"awd-{uid}"

    async def run():
        # As above: the session outlives the restart and the wait (withdrawn, not expired).
        waiter = AsyncOrchestratorClient([victim.target], job_id=f"agone-{uid}", session_ttl=30,
                                         retry=RetryPolicy(failover_window=1.0, attempt_timeout=1.0))
        try:
            task = asyncio.ensure_future(waiter.acquire(g))
            while not holder.status(g).waiters:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(victim.kill)
            with pytest.raises(UnavailableError):
                await asyncio.wait_for(task, 30)
            assert holder.status(g).waiters
            victim.extra = [*victim.extra, "--listen", victim.target]
            await asyncio.to_thread(victim.start)
            await asyncio.to_thread(wait_for, lambda: not holder.status(g).waiters, 20, "withdrawn")
            assert not waiter.session_lost
        finally:
            await waiter.close()

    try:
        holder.create_group(g, ["node-x"])
        holder.acquire(g)
        asyncio.run(run())
        holder.yield_(g)
        st = holder.status(g)
        assert st.holder is None and not st.waiters, f"ghost: {st}"
    finally:
        holder.close()
