"""The etcd test harness does what the other tests rely on: real servers that
serve, fail over, pause, rejoin, and always go away."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import aetcd
import pytest

from timeslice.launcher import pids
from timeslice.testing import etcd as etcd_mod
from timeslice.testing.etcd import EtcdCluster, EtcdHarnessError
from timeslice.testing.procs import pid_alive


def _grant_lease(cluster: EtcdCluster, ttl: int = 60) -> int:
    out = cluster.etcdctl("lease", "grant", str(ttl))  # "lease 694d... granted with TTL(60s)"
    return int(re.search(r"lease ([0-9a-f]+) granted", out).group(1), 16)


def test_single_member_put_get(etcd, key_prefix):
    key = f"{key_prefix}hello"
    etcd.etcdctl("put", key, "world")
    assert etcd.etcdctl("get", key, "--print-value-only").strip() == "world"
    assert etcd.leader() is etcd.members[0]
    assert etcd.endpoints_str == etcd.members[0].endpoint


async def test_aetcd_client_reaches_the_member(etcd, key_prefix):
    host, port = etcd.endpoints[0].split(":")
    client = aetcd.Client(host, int(port))
    try:
        await client.put(f"{key_prefix}k".encode(), b"v")
        got = await client.get(f"{key_prefix}k".encode())
        assert got.value == b"v"
    finally:
        await client.close()


def test_cluster_survives_leader_kill_and_restart_rejoins(etcd3, key_prefix):
    old = etcd3.leader()
    old.kill()
    assert not old.is_running()
    etcd3.wait_healthy(10)
    new = etcd3.leader()
    assert new is not old
    etcd3.etcdctl("put", f"{key_prefix}while-down", "x")

    old.restart()
    etcd3.wait_healthy(15)
    # A linearizable read through the restarted member alone: it must have caught up.
    got = etcd3.etcdctl("get", f"{key_prefix}while-down", "--print-value-only",
                        endpoints=[old.endpoint])
    assert got.strip() == "x"


def test_paused_leader_is_replaced_and_comes_back(etcd3, key_prefix):
    old = etcd3.leader()
    old.pause()
    assert old.is_running() and old.paused
    assert not old.healthy(timeout=0.5)
    with pytest.raises(EtcdHarnessError):
        etcd3.etcdctl("get", "x", endpoints=[old.endpoint], timeout=1)
    etcd3.wait_healthy(10)
    assert etcd3.leader() is not old
    etcd3.etcdctl("put", f"{key_prefix}during-pause", "y")

    old.resume()
    etcd3.wait_healthy(10)
    got = etcd3.etcdctl("get", f"{key_prefix}during-pause", "--print-value-only",
                        endpoints=[old.endpoint])
    assert got.strip() == "y"


def test_pause_resume_single_member(fresh_etcd):
    member = fresh_etcd.members[0]
    member.pause()
    with pytest.raises(EtcdHarnessError):
        fresh_etcd.etcdctl("get", "x", timeout=1)
    member.resume()
    fresh_etcd.wait_healthy(10)
    fresh_etcd.etcdctl("put", "x", "1")


def test_heal_restarts_and_resumes_members(etcd3):
    etcd3.members[0].kill()
    etcd3.members[1].pause()
    etcd3.heal()
    assert all(m.is_running() and not m.paused and m.healthy() for m in etcd3.members)


def test_revoke_lease_deletes_leased_key(etcd, key_prefix):
    lease = _grant_lease(etcd)
    assert lease in etcd.leases()
    etcd.etcdctl("put", f"{key_prefix}leased", "v", f"--lease={lease:x}")
    etcd.revoke_lease(lease)
    assert etcd.etcdctl("get", f"{key_prefix}leased").strip() == ""
    assert lease not in etcd.leases()


def test_stop_leaves_no_process_and_no_dir():
    cluster = EtcdCluster(size=3).start()
    cluster.members[1].pause()  # a stopped process must still be ended
    pids = [m.pid for m in cluster.members]
    data_dir = os.path.dirname(cluster.members[0].data_dir)
    cluster.stop()
    assert not any(pid_alive(p) for p in pids)
    assert not os.path.exists(data_dir)
    assert cluster not in etcd_mod.live_clusters()


def test_exit_without_stop_kills_members(tmp_path):
    # A test process that dies without tearing down must not leak etcd.
    script = textwrap.dedent("""
        from timeslice.testing.etcd import EtcdCluster
        c = EtcdCluster(size=1).start()
        print(c.members[0].pid, flush=True)
        raise SystemExit(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert not pid_alive(int(done.stdout.strip()))


def test_port_collision_is_retried(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = etcd_mod.free_port
    handed = iter([taken.getsockname()[1]])
    monkeypatch.setattr(etcd_mod, "free_port", lambda: next(handed, None) or real())
    try:
        with EtcdCluster(size=1) as cluster:
            assert cluster.members[0].client_port != taken.getsockname()[1]
            cluster.etcdctl("put", "k", "v")
    finally:
        taken.close()


@pytest.mark.parametrize("script", ["sleep 300 & echo $!; wait",  # leader waits for its child
                                    "sleep 300 & echo $!"])        # leader leaves an orphan
def test_proc_reaper_kills_process_group(proc_reaper, script):
    proc = proc_reaper.spawn(["sh", "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc_reaper.reap()
    assert proc.poll() is not None
    assert not pid_alive(child) or _is_zombie(child)


def _is_zombie(pid: int) -> bool:
    # The grandchild is reparented to init, which may not have reaped it yet.
    return pids.state(pid) in (None, "Z")


def test_harness_servers_are_the_launchers_processes(etcd, key_prefix, tmp_path):
    """The harness adds faults on top of the launcher's processes: the command line a test's lockd
    and agent run is the one the launcher builds, recorded by the launcher's spawn line."""
    from timeslice.launcher.servers import LockdReplica, NodeAgent
    from timeslice.testing.agent import AgentProcess
    from timeslice.testing.lockd import LockdProcess

    rep = LockdProcess(etcd.endpoints_str, key_prefix, "r0", str(tmp_path), [])
    agent = AgentProcess(etcd.endpoints_str, key_prefix, "n-harness", str(tmp_path), sim_dir=tmp_path / "sim")
    assert isinstance(rep, LockdReplica) and isinstance(agent, NodeAgent)
    with rep, agent:
        for proc in (rep, agent):
            spawned = proc.events("launcher_spawned")
            assert [ev["argv"] for ev in spawned] == [proc.command()], proc.label
        assert rep.port and agent.port
        rep.kill()
        rep.restart()                     # same identity, same log: one more spawn line
        assert [ev["argv"] for ev in rep.events("launcher_spawned")] == [rep.command()] * 2


async def test_raw_job_resends_a_waiting_acquire_when_its_replica_stalls_and_keeps_its_place(
        etcd, key_prefix, tmp_path):
    """The raw job client (benchmarks, chaos): an Acquire waiting on a replica that stops answering
    is re-sent to the next one, the first left running, and is granted at the queue place it had."""
    import asyncio

    from timeslice.proto import lockd_pb2 as pb
    from timeslice.proto import lockd_pb2_grpc as pbg
    from timeslice.testing.lockd import LockdCluster, admin_channel
    from timeslice.testing.rawjob import RawJob

    lockd = await asyncio.to_thread(LockdCluster(etcd.endpoints_str, key_prefix, n=2, logdir=str(tmp_path),
                                                 extra=["--lease-ttl", "3", "--renew-deadline", "2",
                                                        "--retry-period", "0.5"]).start)
    t = [r.target for r in lockd.replicas]
    holder = await RawJob("holder", [t[1]]).open()
    waiter = await RawJob("waiter", t, home=0, rpc_timeout=0.5).open()
    keep = asyncio.create_task(waiter.keepalive_loop(0.5))
    try:
        async with admin_channel(t[1]) as ch:
            stub = pbg.LockdStub(ch)
            await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
            first = await holder.acquire("g")
            pending = asyncio.ensure_future(waiter.acquire("g", timeout=60))
            while not (st := await stub.GetGroupStatus(pb.GroupRef(group_id="g"), timeout=10)).waiters:
                await asyncio.sleep(0.05)
            place = st.waiters[0].token
            await asyncio.to_thread(lockd.replicas[0].pause)
            try:
                while waiter.target != t[1]:          # the keepalive gives the silent replica up
                    await asyncio.sleep(0.05)
                await holder.yield_("g", first.token)
                got = await asyncio.wait_for(pending, 60)
            finally:
                await asyncio.to_thread(lockd.replicas[0].resume)
        assert (got.token, waiter.answered_by) == (place, t[1])
        assert ("Acquire", "moved") in waiter.resends and waiter.seq == 2
    finally:
        keep.cancel()
        for j in (holder, waiter):
            await j.close()
        await asyncio.to_thread(lockd.stop)


async def test_raw_job_returns_only_its_newest_acquire_attempt_so_a_late_one_leaves_no_ghost(
        etcd, key_prefix, tmp_path):
    """The raw job client: an older Acquire attempt that is granted while a newer one waits on a
    stopped replica does not count. Returning it (and yielding it) let the newer attempt, once its
    replica ran again, enqueue the job afresh: a grant for nobody (the fit netns chaos scenario)."""
    import asyncio

    from timeslice.proto import lockd_pb2 as pb
    from timeslice.proto import lockd_pb2_grpc as pbg
    from timeslice.testing.lockd import LockdCluster, admin_channel
    from timeslice.testing.rawjob import RawJob

    lockd = await asyncio.to_thread(LockdCluster(etcd.endpoints_str, key_prefix, n=2, logdir=str(tmp_path),
                                                 extra=["--lease-ttl", "3", "--renew-deadline", "2",
                                                        "--retry-period", "0.5"]).start)
    t = [r.target for r in lockd.replicas]
    holder = await RawJob("holder", [t[0]]).open()
    waiter = await RawJob("waiter", t, home=0, rpc_timeout=0.5).open()
    keep = None
    try:
        async with admin_channel(t[0]) as ch:
            stub = pbg.LockdStub(ch)

            async def status():
                return await stub.GetGroupStatus(pb.GroupRef(group_id="g"), timeout=10)

            await stub.CreateGroup(pb.CreateGroupRequest(group_id="g"), timeout=10)
            first = await holder.acquire("g")
            pending = asyncio.ensure_future(waiter.acquire("g", timeout=60))
            while not (st := await status()).waiters:      # attempt 1, on replica 0
                await asyncio.sleep(0.05)
            place = st.waiters[0].token
            await asyncio.to_thread(lockd.replicas[1].pause)
            resumed = False
            try:
                waiter.leave(0, "test: move to the stopped replica")   # attempt 2, on replica 1: stuck
                while waiter.seq < 2:
                    await asyncio.sleep(0.01)
                await holder.yield_("g", first.token)       # attempt 1's entry is granted on replica 0
                while not (st := await status()).HasField("grant"):
                    await asyncio.sleep(0.05)
                # Its keepalive now gives the stopped replica up: attempt 3, on replica 0, takes the entry over.
                keep = asyncio.create_task(waiter.keepalive_loop(0.3))
                got = await asyncio.wait_for(pending, 60)
                assert (got.token, waiter.seq, waiter.answered_by) == (place, 3, t[0])
                await waiter.yield_("g", got.token)
                await asyncio.to_thread(lockd.replicas[1].resume)
                resumed = True
                # Attempt 2 (cancelled, or stale by its number when replica 1 gets to it) enqueues nothing.
                for _ in range(30):
                    st = await status()
                    assert not st.HasField("holder") and not st.waiters, st
                    await asyncio.sleep(0.1)
            finally:
                if not resumed:
                    await asyncio.to_thread(lockd.replicas[1].resume)
    finally:
        if keep is not None:
            keep.cancel()
        for j in (holder, waiter):
            await j.close()
        await asyncio.to_thread(lockd.stop)
