"""Chaos scenarios that leave a half-done swap to a new leader or a new agent (the states a long fault run found).

The world of ``test_swap_faults.py`` (one SIMULATED node whose device holds about one job; two
checkpointed and two cooperative jobs on ``g0``, two plain jobs on ``g1``), in the configuration
``timeslice up`` runs: the agent acts only on attested workers and every job's process attests
itself. Each scenario reaches one state a long fault run found and the suite did not:

* the lockd leader and the job holding ``g0`` SIGKILLed at one moment;
* a parked checkpoint job SIGKILLed and started again under its own job id;
* the etcd raft leader SIGSTOPped and the lockd leader SIGKILLed at one moment;
* the node agent SIGKILLed while cooperative jobs are parked, with the lockd leader killed too;
* a cooperative job SIGKILLed in the middle of its pause.

Judged besides the lock's own rules by ``memory-back`` (no grant while the job's memory is not
back), ``heal`` (each group asked for is granted within 10 s of every heal) and ``device``.
"""
from __future__ import annotations

import os
import time

import pytest

from chaos_tests.scenario import ClientKind
from chaos_tests.simnode import SimNode, in_flight
from chaos_tests.test_scenarios import verdict, world  # noqa: F401 - the fixture
from chaos_tests.test_swap_faults import CKPT_BYTES, COOP, NODE_GROUPS, SWAP_FLAGS, jobs_of, swap_figures, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(400)]

ROUNDS = 3                      # each scenario's fault, repeated
#: TIMESLICE_CHAOS_TIMINGS=up: lockd, the agent and the jobs on `timeslice up`'s timings (session TTL
#: 10 s, agent lease 10 s, refresh 2 s, copies at local.env's bandwidths); else the suite's short ones.
UP_TIMINGS = os.environ.get("TIMESLICE_CHAOS_TIMINGS", "") == "up"
STRETCH = 2.0 if UP_TIMINGS else 1.0      # up's timings: a fault takes longer to heal (session TTL 10 s)


def swap_world(world, etcd3, name: str, seed: int):  # noqa: F811
    """test_swap_faults.py's world (attestation required), on the suite's timings or on up's."""
    up = {"lockd_base": [], "session_ttl": 10} if UP_TIMINGS else {"lockd_flags": SWAP_FLAGS}
    w = world(name, seed=seed, groups=2, group_nodes=NODE_GROUPS, observe=True, kinds=[], **up)
    node = SimNode(w, etcd3.endpoints_str, **({"agent_flags": [], "checkpoint_gbps": 1.8, "restore_gbps": 4.5,
                                               "coop_gbps": 4.5} if UP_TIMINGS else {}))
    w.kinds[:] = [node.checkpoint_jobs(2, CKPT_BYTES, ["g0"]), node.cooperative_jobs(2, COOP, ["g0"]),
                  ClientKind(2, groups=["g1"])]
    return w, node


def _ready(w, c, timeout: float = 60.0):
    """Wait until a client spawned now is past its start (its SIGTERM handler set), and return it: a
    world that finishes must not catch it importing."""
    deadline = time.monotonic() + timeout
    while b"CLIENT_READY" not in w._read(c.log_path) and c.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return c


def _session_gone(w, job: str, timeout: float = 30.0) -> None:
    """Until etcd has dropped ``job``'s session (its killed process's lease ran out): from then on the
    lock may go past it, so that is where the fault heals."""
    old = w.observer._leases.get(job)
    wait_for(lambda: w.observer._leases.get(job) != old or old is None, timeout)


def _device_holder(w, node, timeout: float = 8.0):
    """A job holding ``g0`` (a device job) right now, if one is seen within ``timeout``."""
    device_jobs = jobs_of(w, node, "cooperative") | jobs_of(w, node, "checkpoint")
    got = wait_for(lambda: [c for c in w.holders() if c.job in device_jobs], timeout)
    return got[0] if got else None


def test_lockd_leader_and_holder_killed_at_one_moment(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "leader-and-holder-kill", seed=3301)
    node.agent.start()
    w.start(duration=STRETCH * (10 + 9 * ROUNDS))
    caught = 0
    for _ in range(ROUNDS):
        w.sleep(2, 3)
        holder = _device_holder(w, node)
        leader, epoch = w.lockd_leader()
        leader.kill()
        info = w.kill_client(holder) if holder else {}
        caught += bool(holder)
        f = w.fault("SIGKILL lockd leader and the job holding g0 together", replica=leader.replica_id, **info)
        w.wait_new_leader(epoch)
        if holder:
            _session_gone(w, holder.job)
        w.healed(f, "new lockd leader, the holder's session gone")
        leader.start()
        if holder and w.remaining() > 10:
            _ready(w, w.respawn(holder, w.remaining()))
    report = w.finish()
    swap_figures(w)
    verdict(w, report)
    assert caught >= 2, f"a device job was seen holding g0 at only {caught} of {ROUNDS} kills"


def test_parked_checkpoint_job_killed_and_restarted_under_its_id(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "parked-ckpt-restarted", seed=3302)
    node.agent.start()
    w.start(duration=STRETCH * (12 + 9 * ROUNDS))
    ckpt = jobs_of(w, node, "checkpoint")
    caught = 0
    for _ in range(ROUNDS):
        w.sleep(2, 3)
        parked = wait_for(lambda: w.observer.in_state({"snapshotted"}, ckpt), 10)
        job = parked[0][1] if parked else w.rng.choice(sorted(ckpt))
        victim = next((c for c in w.live_clients() if c.job == job), None)
        if victim is None:
            continue
        caught += bool(parked)
        info = w.kill_client(victim)
        f = w.fault("SIGKILL a parked checkpoint job", parked=bool(parked), **info)
        w.sleep(0.2, 1.0)
        # The same job id again, in a new process (a job restarted by its launcher): its first
        # session waits out the old one; its new worker has no memory of the old one's.
        _ready(w, w.spawn_client(max(8.0, w.remaining()), job=job, kind=victim.kind))
        w.healed(f, f"{job} started again under its id")
    report = w.finish()
    swap_figures(w)
    verdict(w, report)
    assert caught >= 2, f"a checkpoint job was seen parked at only {caught} of {ROUNDS} kills"


def test_etcd_raft_leader_stopped_and_lockd_leader_killed(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "raft-stop-lockd-kill", seed=3303)
    node.agent.start()
    w.start(duration=STRETCH * (10 + 10 * ROUNDS))
    for _ in range(ROUNDS):
        w.sleep(2, 3)
        member = etcd3.leader()
        leader, epoch = w.lockd_leader()
        member.pause()
        leader.kill()
        pause = w.rng.uniform(2.0, 4.0)
        f = w.fault("SIGSTOP etcd raft leader and SIGKILL lockd leader", member=member.name,
                    replica=leader.replica_id, pause_s=round(pause, 2))
        time.sleep(pause)
        member.resume()
        w.wait_new_leader(epoch)
        w.healed(f, f"SIGCONT etcd {member.name}, new lockd leader")
        leader.start()
        etcd3.wait_healthy(30)
    report = w.finish()
    swap_figures(w)
    verdict(w, report)


def test_agent_killed_with_cooperative_jobs_parked_and_lockd_leader_killed(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "agent-and-leader-kill-coop-parked", seed=3304)
    node.agent.start()
    w.start(duration=STRETCH * (12 + 10 * ROUNDS))
    coop = jobs_of(w, node, "cooperative")
    caught = 0
    for _ in range(ROUNDS):
        w.sleep(2, 3.5)
        parked = wait_for(lambda: in_flight(w, "coop_paused", "coop_resuming", coop), 8)
        caught += bool(parked)
        leader, epoch = w.lockd_leader()
        node.kill_agent()
        leader.kill()
        f = w.fault("SIGKILL node agent (cooperative jobs parked) and lockd leader", paused=parked or "none seen",
                    replica=leader.replica_id)
        w.sleep(2.0, 3.5)                  # as `timeslice up` would restart it
        node.restart_agent()
        w.wait_new_leader(epoch)
        w.healed(f, "node agent restarted, new lockd leader")
        leader.start()
    report = w.finish()
    swap_figures(w)
    verdict(w, report)
    assert caught >= 2, f"a cooperative job was seen parked at only {caught} of {ROUNDS} kills"


def test_cooperative_job_killed_in_its_pause(world, etcd3):  # noqa: F811
    w, node = swap_world(world, etcd3, "coop-killed-in-pause", seed=3305)
    node.agent.start()
    w.start(duration=STRETCH * (12 + 9 * ROUNDS))
    coop = jobs_of(w, node, "cooperative")
    caught = 0
    for _ in range(ROUNDS):
        w.sleep(2, 3)
        pausing = wait_for(lambda: in_flight(w, "coop_pausing", "coop_paused", coop), 10)
        if not pausing:
            continue
        victim = next((c for c in w.live_clients() if c.job == pausing[0]), None)
        if victim is None:
            continue
        caught += 1
        info = w.kill_client(victim)
        f = w.fault("SIGKILL a cooperative job in its pause", **info)
        w.healed(f, "(instantaneous)")          # from here its death is there to be seen
        coop.discard(victim.job)
        if w.remaining() > 10:
            coop.add(_ready(w, w.respawn(victim, w.remaining())).job)
    report = w.finish()
    swap_figures(w)
    verdict(w, report)
    assert caught >= 2, f"a cooperative job was caught in its pause at only {caught} of {ROUNDS} tries"
