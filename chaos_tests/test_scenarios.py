"""Chaos scenarios: faults against real processes, judged by the history checker.

Each scenario runs a 3-member etcd, 3 lockd replicas and several client
processes (``client_proc.py``) looping acquire → fenced critical section →
yield on two groups, injects its faults on a seeded schedule, then merges
every process's history and asserts the checker found no violation and
that enough grants happened to mean something. Figures are printed (run
with ``-s``) and kept in the test's tmp dir (``figures.txt``, ``history/``,
``logs/``), or under ``$CHAOS_ARTIFACTS`` when set. Replay a failing
schedule with ``CHAOS_SEED=<seed>``.
"""
from __future__ import annotations

import os
import time

import pytest

from chaos_tests.scenario import LEASE_TTL, SESSION_TTL, World, scenario_seed

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

MIN_GRANTS = 20
# The scenarios of plain clients run for both sharing policies: an exclusive group (the mutex) and a fit
# group (holders side by side within the capacity of a simulated GPU; chaos_tests/fitrules.py).
SHARINGS = pytest.mark.parametrize("sharing", ["exclusive", "fit"])


@pytest.fixture
def world(etcd3, key_prefix, tmp_path, proc_reaper):
    """Makes the scenario's World; on the way out stops lockd (and whatever the scenario added)."""
    made: list[World] = []

    def make(name: str, seed: int, **kw) -> World:
        seed = scenario_seed(seed)
        # $CHAOS_ARTIFACTS keeps histories and logs beyond pytest's tmp dir rotation.
        keep = os.environ.get("CHAOS_ARTIFACTS")
        workdir = os.path.join(keep, f"{name}-seed{seed}-{int(time.time())}") if keep else tmp_path
        w = World(etcd3, key_prefix, workdir, proc_reaper, seed=seed, name=name, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def verdict(w: World, report) -> None:
    assert report.violations == [], "\n".join(report.violations[:20])
    assert w.crashes == [], f"client processes died on their own: {w.crashes}"
    assert report.grants > MIN_GRANTS, f"only {report.grants} grants: the scenario proved little"
    if w.sharing == "fit":
        assert w.max_holders() >= 2, "no two holders of a fit group at once: the scenario shared nothing"


def kill_leaders(w: World, times: int) -> None:
    """SIGKILL the lockd leader ``times`` times, a few seconds apart, restarting each on its port."""
    for _ in range(times):
        w.sleep(3, 5)
        leader, epoch = w.lockd_leader()
        f = w.fault("SIGKILL lockd leader", replica=leader.replica_id, epoch=epoch)
        leader.kill()
        new, new_epoch = w.wait_new_leader(epoch)
        w.healed(f, f"new leader {new.replica_id} epoch {new_epoch}")
        w.sleep(0.5, 1.5)
        leader.start()                          # same port: clients find it again


@SHARINGS
def test_lockd_leader_sigkill_repeatedly(world, sharing):
    """SIGKILL the lockd leader three times (restarting it each time): no waiter is lost."""
    w = world("lockd-leader-kill", seed=101, sharing=sharing).start(duration=24)
    kill_leaders(w, 3)
    verdict(w, w.finish())


def test_priority_classes_through_leader_kills(world):
    """Groups with priority classes, every turn a random class: overtaken waiters are moved under
    fresh keys while the leader is killed twice; tokens still increase in grant order (the fence
    never refuses a fresh grant), no waiter is lost, the mutex holds."""
    # observe: the observer writes when each entry was created (``enqueued``), which the priority
    # rules (FIFO within a class, at most 3 overtakes) judge from.
    w = world("priority-leader-kill", seed=505, max_overtakes=3, client_args=["--priorities", "0,9"],
              observe=True).start(duration=18)
    kill_leaders(w, 2)
    report = w.finish()
    verdict(w, report)
    assert report.fence_rejections == 0, "a grant's token was below one the fence had accepted"
    assert sum(e["ev"] == "enqueued" for e in w.all_events) >= report.grants // 2, "too few entries observed"


@SHARINGS
def test_lockd_leader_sigstop_past_its_lease(world, sharing):
    """SIGSTOP the leader for longer than its lease, then SIGCONT: it must not grant on waking."""
    w = world("lockd-leader-pause", seed=202, sharing=sharing).start(duration=26)
    for _ in range(3):
        w.sleep(2, 4)
        leader, epoch = w.lockd_leader()
        pause = LEASE_TTL + w.rng.uniform(1.0, 2.5)
        f = w.fault("SIGSTOP lockd leader", replica=leader.replica_id, epoch=epoch, pause_s=round(pause, 2))
        leader.pause()
        time.sleep(pause)
        leader.resume()
        w.healed(f, f"SIGCONT {leader.replica_id}")
    verdict(w, w.finish())


@SHARINGS
def test_etcd_member_kill_and_raft_leader_kill(world, sharing, etcd3):
    """Kill an etcd follower and bring it back; then kill the raft leader and bring it back."""
    w = world("etcd-member-kill", seed=303, sharing=sharing).start(duration=28)
    for role in ("follower", "raft leader", "raft leader"):
        w.sleep(2, 4)
        leader = etcd3.leader()
        victim = leader if role == "raft leader" else w.rng.choice([m for m in etcd3.members if m is not leader])
        f = w.fault(f"SIGKILL etcd {role}", member=victim.name)
        victim.kill()
        w.sleep(2, 4)
        victim.restart()
        etcd3.wait_healthy(30)
        w.healed(f, f"etcd {victim.name} back")
    verdict(w, w.finish())


@SHARINGS
def test_client_sigkill_while_holding_and_pause_past_session_ttl(world, sharing):
    """SIGKILL clients inside their critical section; SIGSTOP others there past their session TTL.

    A killed holder's session lapses and the next waiter proceeds. A paused
    holder wakes up believing it still holds: its closing fenced operation is
    refused if someone else has used the resource since, and its next call
    fails with session lost (an ``error`` in the history), never a second
    holder.
    """
    w = world("client-kill-pause", seed=404, client_args=["--cs-ms", "40,150"], sharing=sharing).start(duration=32)
    paused = []
    for i in range(4):
        w.sleep(2, 4)
        c = w.wait_for_holder()
        if i % 2 == 0:
            info = w.kill_client(c)
            w.fault("SIGKILL client holding a group", **info)
            w.spawn_client(max(5.0, w.remaining()))
        else:
            pause = SESSION_TTL + w.rng.uniform(1.5, 3.0)
            w.pause_client(c)
            stopped = time.monotonic()
            f = w.fault("SIGSTOP client holding a group", job=c.job, pause_s=round(pause, 2))
            time.sleep(pause)
            woke = time.monotonic()           # before SIGCONT: the client may act before healed() notes it
            w.resume_client(c)
            w.healed(f, f"SIGCONT {c.job}")
            paused.append((c, stopped, woke))
    report = w.finish()
    verdict(w, report)
    for c, stopped, resumed in paused:
        before = [e for e in w.client_events(c) if e["t"] < stopped * 1e9 and e["ev"] in ("cs_start", "cs_end")]
        if not before or before[-1]["ev"] != "cs_start":
            continue          # its section had ended (its Yield on the way) before the signal landed
        after = [e for e in w.client_events(c) if e["t"] > resumed * 1e9 and e["ev"] in ("granted", "yield", "error")]
        assert after and after[0]["ev"] == "error" and after[0].get("kind") == "RawSessionLost", (
            f"{c.job} woke from a pause past its TTL; its next outcome was {after[:1]}")


@SHARINGS
def test_lockd_replica_cut_off_from_etcd_by_relay(world, sharing, etcd3):
    """Partition one replica from etcd (relays that stop passing bytes): the leader, then a follower.

    Runs without root: each replica reaches etcd only through its own
    ``netproxy.Relay``s, which can silently stop passing bytes in both
    directions and later let the held bytes through, late. A cut leader
    cannot renew its lease; another replica takes over; whatever the old one
    had in flight reaches etcd after the heal and must be refused by the
    leader-epoch guard. Clients of a cut replica move to the others.
    """
    from chaos_tests.netproxy import Relay

    w = world("lockd-partition-relay", seed=505, sharing=sharing)
    relays = {r.replica_id: [Relay(ep) for ep in etcd3.endpoints] for r in w.lockd.replicas}
    try:
        for r in w.lockd.replicas:
            r.endpoints = ",".join(x.endpoint for x in relays[r.replica_id])
        w.start(duration=30)
        for role in ("leader", "follower", "leader"):
            w.sleep(2, 4)
            leader, epoch = w.lockd_leader()
            victim = leader if role == "leader" else w.rng.choice([r for r in w.lockd.replicas if r is not leader])
            span = (LEASE_TTL + w.rng.uniform(1.0, 3.0)) if role == "leader" else w.rng.uniform(2.0, 5.0)
            f = w.fault(f"cut lockd {role} off etcd (relay)", replica=victim.replica_id, epoch=epoch,
                        for_s=round(span, 2))
            for x in relays[victim.replica_id]:
                x.cut()
            time.sleep(span)
            for x in relays[victim.replica_id]:
                x.heal()
            w.healed(f, f"relay healed for {victim.replica_id}")
        verdict(w, w.finish())
    finally:
        for rs in relays.values():
            for x in rs:
                x.close()


MiB = 1 << 20


def test_node_agent_killed_mid_snapshot_and_restarted(world, etcd3, tmp_path):
    """SIGKILL the node agent while it copies a job's device memory out; restart it.

    Four jobs share one group on one node whose SIMULATED device holds one
    job at a time, so every handoff is a real swap: snapshot the resident job
    (its bytes copied to host memory, checksummed), restore the incoming one.
    Copies are slowed down so the agent can be caught mid-snapshot (a
    ``.partial`` host copy exists). Every client checks in each critical
    section that its device bytes are exactly what it left there
    (``data_check``); a grant made before the job's context is back fails it.
    """
    from timeslice.common.sim.device import SimDevice
    from timeslice.testing.agent import AgentProcess

    sim, host = tmp_path / "sim", tmp_path / "host"
    job_bytes = 4 * MiB
    SimDevice(sim, host, capacity_bytes=6 * MiB)           # room for one job, not two
    env = {"TIMESLICE_SIM_HOST_DIR": str(host)}
    w = world("agent-kill-mid-snapshot", seed=606, groups=1, clients=4, group_nodes=["node-a"],
              lockd_flags=["--swap-timeout", "10"], client_env=env,
              client_args=["--sim-bytes", str(job_bytes), "--sim-dir", str(sim), "--node", "node-a",
                           "--cs-ms", "5,30", "--device-timeout", "5"])
    agent = AgentProcess(etcd3.endpoints_str, w.prefix, "node-a", w.log_dir, sim_dir=sim, env=env,
                         extra=["--sim-checkpoint-gbps", "0.02", "--sim-restore-gbps", "0.05",
                                "--agent-lease-ttl", "3", "--refresh-interval", "0.5", "--lock-timeout-ms", "3000"])
    w.on_stop.append(lambda: agent.alive() and (agent.resume(), agent.stop()))
    agent.start()
    w.start(duration=34)
    for _ in range(4):
        w.sleep(2, 4)
        deadline = time.monotonic() + 10
        while not any(p.name.endswith(".partial") for p in host.iterdir()):
            assert time.monotonic() < deadline, "no snapshot in progress within 10 s"
            time.sleep(0.002)
        partial = [p.name for p in host.iterdir() if p.name.endswith(".partial")]
        agent.kill()
        f = w.fault("SIGKILL node agent mid-snapshot", partial=partial)
        w.sleep(0.3, 1.5)
        agent.start()
        w.healed(f, "node agent restarted")
    report = w.finish()
    events = w.all_events
    checks = [e for e in events if e["ev"] == "data_check" and e.get("token")]
    restored = [e for e in events if e["ev"] == "granted" and e.get("restored")]
    print(f"  device data checks in sections: {len(checks)}, grants with a restore: {len(restored)}")
    verdict(w, report)
    assert len(checks) > 10 and len(restored) > 10, "the scenario must exercise real swaps"


def test_lockd_replica_cut_off_from_etcd_by_iptables_in_netns(world, etcd3):
    """Partition one replica from etcd with iptables in its own network namespace: leader, then follower.

    Needs root, ``ip netns`` and iptables; skipped otherwise, with the reason.
    The replica runs inside the namespace and reaches etcd over a veth; the
    cut drops its packets in the kernel (TCP retransmits them after the
    heal). Started first, it leads when first cut; after that it is a follower.
    """
    from chaos_tests.netns import Netns, NetnsLockdProcess, NetnsUnavailable
    from chaos_tests.netproxy import Relay
    from timeslice.testing.ports import free_port

    try:
        ns = Netns.create()
    except NetnsUnavailable as e:
        print(f"SKIP netns partition scenario: {e}")
        pytest.skip(f"netns partition scenario: {e}")
    bridges: list[Relay] = []
    try:
        bridges = [Relay(ep, listen_host=ns.host_ip) for ep in etcd3.endpoints]
        w = world("lockd-partition-netns", seed=707)
        w.on_stop.append(ns.delete)
        base = w.lockd.replicas[2]
        cut = NetnsLockdProcess(ns, ",".join(b.endpoint for b in bridges), w.prefix, base.replica_id, w.log_dir,
                                base.extra, free_port())
        w.replace_replica(2, cut)
        w.start(order=[2, 0, 1], duration=30)
        for _ in range(3):
            w.sleep(2, 4)
            leader, epoch = w.lockd_leader()
            role = "leader" if leader is cut else "follower"
            span = (LEASE_TTL + w.rng.uniform(1.0, 3.0)) if role == "leader" else w.rng.uniform(2.0, 5.0)
            f = w.fault(f"iptables: cut lockd {role} {cut.replica_id} off etcd", epoch=epoch, for_s=round(span, 2))
            ns.cut([b.port for b in bridges])
            time.sleep(span)
            ns.heal()
            w.healed(f, f"iptables rules removed for {cut.replica_id}")
        verdict(w, w.finish())
    finally:
        for b in bridges:
            b.close()
        ns.delete()
