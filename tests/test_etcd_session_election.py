"""Sessions, timing validation and leader election against real etcd."""
import asyncio
import json
import os
import signal
import sys
import time

import pytest

from timeslice.common.errors import ConfigError, NotLeader, SessionLost
from timeslice.common.server.etcd import (
    Election,
    ElectionTiming,
    EtcdClient,
    EtcdConfig,
    Session,
    SessionTiming,
    ops,
    wait_deposed,
)

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


@pytest.fixture
async def client(etcd):
    c = EtcdClient(EtcdConfig.parse(etcd.endpoints_str))
    yield c
    await c.close()


def test_timing_validated_at_construction():
    with pytest.raises(ConfigError):
        ElectionTiming(lease_ttl=3, renew_deadline=3, retry_period=1)
    with pytest.raises(ConfigError):
        ElectionTiming(lease_ttl=5, renew_deadline=1.1, retry_period=1)
    with pytest.raises(ConfigError):
        SessionTiming(ttl=1)
    with pytest.raises(ConfigError):
        SessionTiming(ttl=6, keepalive_interval=4)
    assert SessionTiming(ttl=9).keepalive_interval == 3
    with pytest.raises(ConfigError):
        EtcdConfig.parse("nohostport")


async def test_session_keeps_lease_alive_past_ttl(client, key_prefix):
    async with Session(client, SessionTiming(ttl=2)) as s:
        await client.txn([], [ops.put((key_prefix + "k").encode(), b"v", s.lease_id)])
        await asyncio.sleep(3.5)
        r = await client.range(ops.range_req((key_prefix + "k").encode()))
        assert r.kvs, "keepalives must keep the leased key"
        s.check()


async def test_lost_lease_is_signalled(client, etcd):
    fired = []
    s = await Session(client, SessionTiming(ttl=3, keepalive_interval=0.3), on_lost=fired.append).open()
    etcd.revoke_lease(s.lease_id)
    err = await asyncio.wait_for(s.wait_lost(), 10)
    assert isinstance(err, SessionLost) and fired == [err]
    with pytest.raises(SessionLost):
        s.check()


async def test_close_revokes_and_orphan_lets_expire(client, key_prefix):
    key = (key_prefix + "k").encode()
    s = await Session(client, SessionTiming(ttl=2)).open()
    await client.txn([], [ops.put(key, b"v", s.lease_id)])
    await s.close()
    assert not (await client.range(ops.range_req(key))).kvs, "close revokes at once"
    s = await Session(client, SessionTiming(ttl=2)).open()
    await client.txn([], [ops.put(key, b"v", s.lease_id)])
    s.orphan()
    assert (await client.range(ops.range_req(key))).kvs, "orphan does not revoke"
    deadline = time.monotonic() + 15
    while (await client.range(ops.range_req(key))).kvs:
        assert time.monotonic() < deadline, "orphaned lease must expire"
        await asyncio.sleep(0.2)


async def test_election_resign_and_guard(client, key_prefix):
    prefix = (key_prefix + "el/").encode()
    s1 = await Session(client, SessionTiming(ttl=5)).open()
    s2 = await Session(client, SessionTiming(ttl=5)).open()
    e1, e2 = Election(s1, prefix, b"one"), Election(s2, prefix, b"two")
    l1 = await e1.campaign()
    second = asyncio.ensure_future(e2.campaign())
    await asyncio.sleep(0.3)
    assert not second.done()
    info = await e1.leader()
    assert info.value == b"one" and info.epoch == l1.epoch
    observed = []

    async def observe():
        async for who in e1.observe():
            observed.append(who)
            if len(observed) == 2:
                return

    obs = asyncio.ensure_future(observe())
    await asyncio.sleep(0.2)
    await e1.resign()
    l2 = await asyncio.wait_for(second, 5)
    assert l2.epoch > l1.epoch
    with pytest.raises(NotLeader):
        await l1.txn(success=[ops.put(prefix + b"x", b"stale")])
    assert (await l2.txn(success=[ops.put(prefix + b"x", b"fresh")])).succeeded
    await asyncio.wait_for(obs, 5)
    assert [o.value for o in observed] == [b"one", b"two"]
    assert await asyncio.wait_for(wait_deposed(l1), 5)
    await s1.close(), await s2.close()


def _events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_leader_is_replaced_with_higher_epoch(etcd, key_prefix, tmp_path, proc_reaper):
    out = str(tmp_path / "el.jsonl")
    prefix = key_prefix + "el/"
    procs = {}
    for name in ("a", "b", "c"):
        procs[name] = proc_reaper.spawn([sys.executable, os.path.join(SCRIPTS, "candidate.py"),
                                         etcd.endpoints_str, prefix, name, out, "2"])
    first = _wait_for(lambda: [e for e in _events(out) if e["event"] == "leading"], 30, "a leader")[0]
    os.kill(procs[first["name"]].pid, signal.SIGKILL)
    leads = _wait_for(lambda: (lambda ls: ls if len(ls) >= 2 else None)(
        [e for e in _events(out) if e["event"] == "leading"]), 30, "a second leader")
    assert leads[1]["name"] != first["name"]
    assert leads[1]["epoch"] > first["epoch"]


def test_paused_leader_cannot_write_after_resume(etcd, key_prefix, tmp_path, proc_reaper):
    out = str(tmp_path / "el.jsonl")
    prefix = key_prefix + "el/"
    procs = {}
    for name in ("a", "b"):
        procs[name] = proc_reaper.spawn([sys.executable, os.path.join(SCRIPTS, "candidate.py"),
                                         etcd.endpoints_str, prefix, name, out, "2"])
    first = _wait_for(lambda: [e for e in _events(out) if e["event"] == "leading"], 30, "a leader")[0]
    old = first["name"]
    _wait_for(lambda: [e for e in _events(out) if e["event"] == "write" and e.get("ok")], 10, "a write")
    os.kill(procs[old].pid, signal.SIGSTOP)
    try:
        new = _wait_for(lambda: [e for e in _events(out) if e["event"] == "leading" and e["name"] != old],
                        30, "the other candidate to lead")[0]
    finally:
        os.kill(procs[old].pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    _wait_for(lambda: [e for e in _events(out) if e["name"] == old and e["event"] == "write"
                       and e["t"] > resumed_at], 20, "the old leader to try writing after resume")
    old_writes = [e for e in _events(out) if e["name"] == old and e["event"] == "write"]
    after = [e for e in old_writes if e["t"] > resumed_at]
    assert after and not any(e["ok"] for e in after), "a deposed leader's guarded write succeeded"
    # And no write of the old leader was applied after the new leader started writing.
    new_first = _wait_for(lambda: [e for e in _events(out) if e["name"] == new["name"]
                                   and e["event"] == "write" and e.get("ok")], 10, "a new-leader write")[0]
    assert all(e["revision"] < new_first["revision"] for e in old_writes if e.get("ok"))
