"""An admin force-deletes a group under its holder: the holder learns of it from its
keepalive (lockd lists the group in ``revoked_groups``), its grant is dropped, it is told
(``on_grant_revoked`` + a ``grant_revoked`` log event), and a later yield or hold check raises
``GroupRevokedError``; the session and its other holds live on."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from structlog.testing import capture_logs

from tests.client.helpers import wait_for
from timeslice import (
    AsyncOrchestratorClient,
    GroupRevokedError,
    NotHolderError,
    OrchestratorClient,
    UnknownGroupError,
)


def test_holder_learns_of_the_deletion_from_its_keepalive(lockd, admin, uid, clients):
    g, other = f"rv-{uid}", f"rv2-{uid}"
    admin.create_group(g, ["node-x"])
    admin.create_group(other, ["node-x"])
    told: list = []
    news = threading.Event()

    def on_revoked(err):
        told.append((err, threading.current_thread()))
        news.set()
    c = clients(OrchestratorClient(lockd.targets, job_id=f"rh-{uid}", session_ttl=3, on_grant_revoked=on_revoked))
    kept = c.acquire(other)
    with capture_logs() as events:
        grant = c.acquire(g)
        admin.delete_group(g, force=True)
        assert news.wait(10), "the keepalive (every TTL/3) never reported the deletion"
    err, thread = told[0]
    assert isinstance(err, GroupRevokedError) and err.grant == grant and err.group_id == g
    assert thread is not threading.main_thread() and not thread.name.startswith("timeslice-client")
    assert any(e["event"] == "grant_revoked" and e["group"] == g and e["token"] == grant.token for e in events)
    assert c.held == {other: kept} and not c.session_lost     # the other hold and the session live on
    with pytest.raises(GroupRevokedError, match="deleted"):
        c.check_held(g)
    with pytest.raises(GroupRevokedError) as ei:
        c.yield_(g)
    assert ei.value.code == "ABORTED" and ei.value.grant == grant
    with pytest.raises(NotHolderError):                     # told once; then the ordinary answer
        c.yield_(g)
    # The group is made again: the job's new grant is not taken for the revoked one.
    admin.create_group(g, ["node-x"])
    again = c.acquire(g)
    assert again.token > grant.token
    time.sleep(3 * c.config.keepalive_period)
    assert c.check_held(g) == again and len(told) == 1
    c.yield_(g)
    c.yield_(other)


def test_yield_of_a_deleted_group_is_not_a_session_loss(lockd, admin, uid, clients):
    """lockd answers the holder's Yield with ABORTED group_deleted; that is no session loss."""
    g, other = f"ry-{uid}", f"ry2-{uid}"
    admin.create_group(g, ["node-x"])
    admin.create_group(other, ["node-x"])
    lost = []
    c = clients(OrchestratorClient(lockd.targets, job_id=f"ry-{uid}", session_ttl=60, on_session_lost=lost.append))
    grant = c.acquire(g)                      # a keepalive every 20 s: the yield comes first
    admin.delete_group(g, force=True)
    with pytest.raises(GroupRevokedError) as ei:
        c.yield_(g)
    assert ei.value.reason == "group_deleted" and grant.group_id == g
    assert not c.session_lost and lost == [] and c.held == {}
    assert c.acquire(other).group_id == other  # the session works on
    c.yield_(other)


def test_scope_around_a_deleted_group_raises_when_it_ends(lockd, admin, uid, clients):
    g = f"rs-{uid}"
    admin.create_group(g, ["node-x"])
    c = clients(OrchestratorClient(lockd.targets, job_id=f"rs-{uid}", session_ttl=3))
    with pytest.raises(GroupRevokedError), c.on_accelerators(g):
        admin.delete_group(g, force=True)
        wait_for(lambda: g not in c.held, what="the holder learns of it in the middle of its phase")
    assert not c.session_lost


def test_a_notice_left_from_a_wait_does_not_end_a_later_grant(lockd, admin, uid, clients):
    """The job waited on the group when it was deleted; lockd's notice for that wait is still
    listed by its keepalives when the job holds the re-created group: the grant stays."""
    g = f"rw-{uid}"
    admin.create_group(g, ["node-x"])
    holder = clients(OrchestratorClient(lockd.targets, job_id=f"rwh-{uid}"))
    holder.acquire(g)
    told = []
    c = clients(OrchestratorClient(lockd.targets, job_id=f"rw-{uid}", session_ttl=3, on_grant_revoked=told.append))
    out = {}

    def wait():
        try:
            c.acquire(g, timeout=30)
        except Exception as e:
            out["err"] = e
    t = threading.Thread(target=wait)
    t.start()
    wait_for(lambda: admin.status(g).waiters, what="the job queued")
    admin.delete_group(g, force=True)
    t.join(15)
    assert isinstance(out.get("err"), UnknownGroupError)
    admin.create_group(g, ["node-x"])
    grant = c.acquire(g)
    time.sleep(3 * c.config.keepalive_period)   # keepalives list g (the wait's notice) meanwhile
    assert c.held == {g: grant} and told == []
    c.yield_(g)


async def test_async_holder_is_told_on_its_loop(lockd, admin, uid):
    g = f"ra-{uid}"
    admin.create_group(g, ["node-x"])
    loop = asyncio.get_running_loop()
    news: asyncio.Future = loop.create_future()

    async def on_revoked(err):
        news.set_result((err, asyncio.get_running_loop()))
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"ra-{uid}", session_ttl=3,
                                       on_grant_revoked=on_revoked) as c:
        grant = await c.acquire(g)
        await asyncio.to_thread(admin.delete_group, g, True)
        err, where = await asyncio.wait_for(news, 10)
        assert err.grant == grant and where is loop
        with pytest.raises(GroupRevokedError):
            await c.yield_(g)
        assert not c.session_lost
