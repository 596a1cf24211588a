"""Chaos scenarios around the node agent and its swaps, on a SIMULATED device.

One node (``simnode.py``) whose device holds about one job: two checkpointed jobs (the
agent copies the whole process's arena out and back) and two cooperative ones (the job
pauses and resumes its own regions: an offload region restored bit-exact, a discard
region recreated zeroed) share group ``g0`` on it, so every handoff is a real swap; two
plain jobs share ``g1`` (no devices). Every job checks its device bytes in every section
and says whether its memory was back at the grant; the checker adds ``device``,
``memory-back``, ``parked-orphan`` and ``recovery`` to the lock's own rules.

* the agent SIGKILLed while cooperative workers are paused (parked), restarted 2-3.5 s later;
* the agent SIGKILLed mid-swap: mid-checkpoint, mid-restore, mid-pause, mid-resume;
* two faults at once: the lockd leader and the agent; the lockd leader while the etcd
  raft leader is paused; the agent and a job holding ``g0``;
* the agent cut off from etcd by iptables in its own network namespace (root only;
  skipped otherwise, with the reason), shorter and longer than its lease.
"""
from __future__ import annotations

import time

import pytest

from chaos_tests.scenario import ClientKind, repeats
from chaos_tests.simnode import MiB, SimNode, coop_regions, in_flight
from chaos_tests.test_scenarios import verdict, world  # noqa: F401 - the fixture

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

CKPT_BYTES = 4 * MiB
COOP = coop_regions(3 * MiB, MiB + MiB // 2)       # 1 MiB context + 4.5 MiB of regions
NODE_GROUPS = {"g0": ["node-a"]}
SWAP_FLAGS = ["--swap-timeout", "10"]


def swap_world(world, etcd3, name: str, seed: int, agent_cls=None, endpoints: str | None = None, **agent_kw):  # noqa: F811
    """The world of these scenarios: lockd, the node (agent not started yet) and the job kinds."""
    w = world(name, seed=seed, groups=2, group_nodes=NODE_GROUPS, lockd_flags=SWAP_FLAGS, observe=True,
              kinds=[])
    node = SimNode(w, endpoints or etcd3.endpoints_str, **({"agent_cls": agent_cls} if agent_cls else {}),
                   **agent_kw)
    w.kinds[:] = [node.checkpoint_jobs(2, CKPT_BYTES, ["g0"]), node.cooperative_jobs(2, COOP, ["g0"]),
                  ClientKind(2, groups=["g1"])]
    return w, node


def jobs_of(w, node: SimNode, backend: str) -> set[str]:
    flag = "--coop-regions" if backend == "cooperative" else "--sim-bytes"
    return {c.job for c in w.clients if c.kind is not None and flag in c.kind.args}


def swap_figures(w) -> None:
    ev = w.all_events
    checks = [e for e in ev if e["ev"] == "data_check" and e.get("token")]
    print(f"  device checks in sections: {len(checks)} ({sum(not e['ok'] for e in checks)} failed), "
          f"grants with a restore: {sum(1 for e in ev if e['ev'] == 'granted' and e.get('restored'))}, "
          f"cooperative pauses: {sum(1 for e in ev if e['ev'] == 'coop_paused')}")


def wait_for(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.003)
    return None


def test_agent_killed_while_cooperative_workers_are_parked(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "agent-kill-coop-parked", seed=2501)
    node.agent.start()
    w.start(duration=32)
    coop = jobs_of(w, node, "cooperative")
    caught = 0
    for _ in range(4):
        w.sleep(2, 3.5)
        # The jobs' own word: the last thing the agent asked of them was a pause.
        parked = wait_for(lambda: in_flight(w, "coop_paused", "coop_resuming", coop), 8)
        caught += bool(parked)
        node.kill_agent()
        f = w.fault("SIGKILL node agent while cooperative workers are paused", paused=parked or "none seen")
        # Down for seconds, as `timeslice up` restarts it (~3 s): the workers' reconnect backoff has
        # grown meanwhile, so they come back a moment after the agent does, while jobs keep asking.
        w.sleep(2.0, 3.5)
        node.restart_agent()
        w.healed(f, "node agent restarted")
    report = w.finish()
    swap_figures(w)
    verdict(w, report)
    assert caught >= 2, f"a cooperative worker was seen paused at only {caught} of 4 agent kills"


def test_agent_killed_mid_swap(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "agent-kill-mid-swap", seed=2502)
    node.agent.start()
    w.start(duration=32)
    coop, ckpt = jobs_of(w, node, "cooperative"), jobs_of(w, node, "checkpoint")
    moments = {
        "mid-checkpoint": lambda: node.partials(),
        "mid-restore": lambda: w.observer.in_state({"restoring"}, ckpt),
        "mid-pause": lambda: in_flight(w, "coop_pausing", "coop_paused", coop),
        "mid-resume": lambda: in_flight(w, "coop_resuming", "coop_resumed", coop),
    }
    caught: dict[str, int] = {}
    for moment in moments:
        w.sleep(2, 3)
        seen = wait_for(moments[moment], 8)
        node.kill_agent()
        caught[moment] = caught.get(moment, 0) + bool(seen)
        f = w.fault(f"SIGKILL node agent {moment}", seen=seen or "not caught")
        w.sleep(1.0, 3.0)
        node.restart_agent()
        w.healed(f, "node agent restarted")
    report = w.finish()
    swap_figures(w)
    print(f"  moments caught: {caught}")
    verdict(w, report)
    missed = [m for m in moments if not caught.get(m)]
    assert not missed, f"the agent was never caught {missed}: the scenario did not test those"


def test_two_faults_at_once(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "two-faults-at-once", seed=2503)
    node.agent.start()
    w.start(duration=34)
    # 1. The lockd leader and the node agent, killed together.
    w.sleep(2, 3)
    leader, epoch = w.lockd_leader()
    leader.kill()
    node.kill_agent()
    f = w.fault("SIGKILL lockd leader and node agent together", replica=leader.replica_id, epoch=epoch)
    w.sleep(0.5, 2.0)
    node.restart_agent()
    w.wait_new_leader(epoch)
    w.healed(f, "agent restarted, new lockd leader")
    leader.start()
    # 2. The lockd leader killed while the etcd raft leader is paused.
    w.sleep(2, 3)
    member = etcd3.leader()
    leader, epoch = w.lockd_leader()
    member.pause()
    leader.kill()
    pause = w.rng.uniform(2.0, 3.0)
    f = w.fault("SIGSTOP etcd raft leader and SIGKILL lockd leader", member=member.name,
                replica=leader.replica_id, pause_s=round(pause, 2))
    time.sleep(pause)
    member.resume()
    w.wait_new_leader(epoch)
    w.healed(f, f"SIGCONT etcd {member.name}, new lockd leader")
    leader.start()
    etcd3.wait_healthy(30)
    # 3. The agent and a job holding the node's group.
    w.sleep(2, 3)
    holder = wait_for(lambda: [c for c in w.holders() if c.job in jobs_of(w, node, "cooperative")
                               | jobs_of(w, node, "checkpoint")], 8)
    node.kill_agent()
    info = w.kill_client(holder[0]) if holder else {}
    f = w.fault("SIGKILL node agent and a job holding g0", **info)
    if holder:
        w.respawn(holder[0], max(8.0, w.remaining()))
    w.sleep(0.5, 2.0)
    node.restart_agent()
    w.healed(f, "node agent restarted")
    report = w.finish()
    swap_figures(w)
    verdict(w, report)


def test_agent_cut_off_from_etcd_by_iptables_in_netns(world, etcd3):  # noqa: F811
    from chaos_tests.netns import Netns, NetnsAgentProcess, NetnsUnavailable
    from chaos_tests.netproxy import Relay

    try:
        ns = Netns.create()
    except NetnsUnavailable as e:
        print(f"SKIP agent netns partition scenario: {e}")
        pytest.skip(f"agent netns partition scenario: {e}")
    bridges: list[Relay] = []
    try:
        bridges = [Relay(ep, listen_host=ns.host_ip) for ep in etcd3.endpoints]
        w, node = swap_world(world, etcd3, "agent-partition-netns", seed=2504, agent_cls=NetnsAgentProcess,
                             endpoints=",".join(b.endpoint for b in bridges), ns=ns)
        w.on_stop.append(ns.delete)
        node.agent.start()
        w.start(duration=30)
        spans = (w.rng.uniform(1.0, 2.0), 3 + w.rng.uniform(1.5, 3.0), 3 + w.rng.uniform(1.0, 2.0))
        for span in spans[:repeats(3, 2)]:        # shorter than its lease, then longer
            w.sleep(2, 3.5)
            f = w.fault("iptables: cut node agent off etcd", for_s=round(span, 2), longer_than_its_lease=span > 3)
            ns.cut([b.port for b in bridges])
            time.sleep(span)
            ns.heal()
            w.healed(f, "iptables rules removed for the agent")
        report = w.finish()
        swap_figures(w)
        verdict(w, report)
    finally:
        for b in bridges:
            b.close()
        ns.delete()
