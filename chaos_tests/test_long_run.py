"""The long fault run: 6 jobs on 2 SIMULATED GPUs through the public client library, seeded faults.

    TIMESLICE_CHAOS_LONG=1 .venv/bin/python -m pytest chaos_tests/test_long_run.py -m chaos -s   # >= 10 min
    .venv/bin/python -m pytest chaos_tests/test_long_run.py -m chaos -s                          # CI: ~1 min

One node with two simulated GPUs, each the device of one group (``g0`` on GPU 0, ``g1`` on GPU
1), each GPU holding about one job, so every handoff is a swap. Six jobs, each its own process
driving ``timeslice.OrchestratorClient`` (lib_client.py, lib_device.py): three checkpointed
(the agent copies the process's arena out and back) and three cooperative (the job pauses and
resumes its own regions), two groups' worth, in the configuration ``timeslice up`` runs (the
agent requires attestation; 3 etcd members; 3 lockd replicas). Faults, one every few seconds,
drawn from a seeded schedule: the node agent SIGKILLed in a swap, a cooperative job SIGKILLed in
its pause, an etcd majority lost, an etcd member SIGSTOPped, a parked job SIGKILLed and started
again under its id, and two faults at one moment (the lockd leader with the holder, with the
etcd raft leader's SIGSTOP, with the agent while cooperative jobs are parked).

Judged by every checker rule, among them: no grant with the job's memory not back
(``memory-back``), each group asked for granted within 10 s of every heal (``heal``), no job
told its session is lost while etcd holds its lease (``session-loss``). Printed at the end: the
figures, and the recovery per fault kind (heal to the first grant in any group, and in the
slowest group asked for), which the README's "Fault tolerance" section quotes.
"""
from __future__ import annotations

import json
import os
import statistics

import pytest

from chaos_tests.simnode import MiB, SimNode, coop_regions, in_flight
from chaos_tests.test_heal_faults import _session_gone
from chaos_tests.test_scenarios import verdict, world  # noqa: F401 - the fixture
from chaos_tests.test_swap_faults import SWAP_FLAGS, swap_figures, wait_for

#: TIMESLICE_CHAOS_LONG=1: the long run (>= 10 minutes); else CI's short share of it.
LONG = os.environ.get("TIMESLICE_CHAOS_LONG", "") not in ("", "0")
DURATION_S = float(os.environ.get("TIMESLICE_CHAOS_LONG_S", "0") or 0) or (600.0 if LONG else 60.0)
#: TIMESLICE_CHAOS_TIMINGS=up: lockd, the agent and the jobs on `timeslice up`'s timings (session TTL
#: 10 s, agent lease 10 s, refresh 2 s, reconnect grace 20 s, copies at local.env's bandwidths); the
#: default is the suite's short ones (session TTL 3 s, agent lease 3 s), which see more faults a minute.
UP_TIMINGS = os.environ.get("TIMESLICE_CHAOS_TIMINGS", "") == "up"
#: TIMESLICE_CHAOS_SHARING=fit: both groups are fit groups (lockd/weights.py) on GPUs of FIT_GPU_BYTES, where
#: two of a group's jobs fit side by side and three do not: holds overlap, and handoffs still swap; the
#: checker adds the fit rules (chaos_tests/fitrules.py). The default is exclusive groups on 7 MiB GPUs.
SHARING = os.environ.get("TIMESLICE_CHAOS_SHARING", "") or "exclusive"

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(int(DURATION_S) + 300)]

CKPT_BYTES = 4 * MiB
COOP = coop_regions(3 * MiB, MiB + MiB // 2)           # 1 MiB context + 4.5 MiB of regions
GROUP_GPUS = {"g0": ["node-a:0"], "g1": ["node-a:1"]}
FIT_GPU_BYTES = 11 * MiB                               # fit: a checkpointed job beside another job fits


def long_world(world, etcd3):  # noqa: F811
    up = {"lockd_base": [], "session_ttl": 10} if UP_TIMINGS else {"lockd_flags": SWAP_FLAGS}
    gpu_bytes = FIT_GPU_BYTES if SHARING == "fit" else 7 * MiB
    fit = {"sharing": "fit", "fit_capacity": {n: gpu_bytes for ns in GROUP_GPUS.values() for n in ns}} \
        if SHARING == "fit" else {}
    name = "long-run" if SHARING == "exclusive" else f"long-run-{SHARING}"
    w = world(name, seed=3310, groups=2, group_nodes=GROUP_GPUS, library=True, kinds=[], **up, **fit)
    node = SimNode(w, etcd3.endpoints_str, capacity=gpu_bytes, gpus=2,
                   **({"agent_flags": [], "checkpoint_gbps": 1.8, "restore_gbps": 4.5, "coop_gbps": 4.5}
                      if UP_TIMINGS else {}))
    # g0 (GPU 0): two checkpointed jobs and one cooperative; g1 (GPU 1): one and two.
    w.kinds[:] = [node.checkpoint_jobs(2, CKPT_BYTES, ["g0"], gpu=0), node.cooperative_jobs(1, COOP, ["g0"], gpu=0),
                  node.checkpoint_jobs(1, CKPT_BYTES, ["g1"], gpu=1), node.cooperative_jobs(2, COOP, ["g1"], gpu=1)]
    return w, node


class Faults:
    """The schedule's fault kinds; each injects, waits, heals, and says whether it caught its moment."""

    def __init__(self, w, node, etcd3):
        self.w, self.node, self.etcd3 = w, node, etcd3

    def _kind_jobs(self, flag: str) -> list:
        return [c for c in self.w.live_clients() if c.kind is not None and flag in c.kind.args]

    def _restart_leader_after(self, leader, epoch, f, what: str) -> None:
        self.w.wait_new_leader(epoch)
        self.w.healed(f, what)
        leader.start()

    def agent_in_swap(self) -> bool:
        w, node = self.w, self.node
        coop = {c.job for c in self._kind_jobs("--coop-regions")}
        seen = wait_for(lambda: node.partials() or in_flight(w, "coop_pausing", "coop_paused", coop)
                        or in_flight(w, "coop_resuming", "coop_resumed", coop), 8)
        node.kill_agent()
        f = w.fault("SIGKILL node agent in a swap", seen=seen or "not caught")
        w.sleep(1.0, 3.0)
        node.restart_agent()
        w.healed(f, "node agent restarted")
        return bool(seen)

    def coop_in_pause(self) -> bool:
        w = self.w
        coop = {c.job for c in self._kind_jobs("--coop-regions")}
        pausing = wait_for(lambda: in_flight(w, "coop_pausing", "coop_paused", coop), 8)
        victim = next((c for c in w.live_clients() if pausing and c.job == pausing[0]), None)
        if victim is None:
            return False
        info = w.kill_client(victim)
        f = w.fault("SIGKILL a cooperative job in its pause", **info)
        w.healed(f, "(instantaneous)")
        w.sleep(0.5, 1.5)
        self._again(victim)
        return True

    def _again(self, victim) -> None:
        """The same job id in a new process (a job restarted by its launcher), once it is past its start."""
        from chaos_tests.test_heal_faults import _ready
        if self.w.remaining() > 10:
            _ready(self.w, self.w.spawn_client(self.w.remaining(), job=victim.job, kind=victim.kind))

    def etcd_majority(self) -> bool:
        w, etcd3 = self.w, self.etcd3
        leader = etcd3.leader()
        down = [leader, next(m for m in etcd3.members if m is not leader)]
        for m in down:
            m.kill()
        f = w.fault("etcd majority lost (raft leader and a follower SIGKILLed)", no_quorum=True)
        # Longer than the jobs' session TTL: every client goes a whole TTL without an answered keepalive.
        ttl = w.session_ttl
        w.sleep(ttl + 1.0, ttl + 4.0)
        # The majority is back as soon as the first member is started again (two of three): the heal is
        # recorded then, not once every member is healthy, or a grant made in between would count as
        # made without a majority (the [quorum] rule) when etcd had one.
        down[0].restart()
        w.healed(f, "etcd majority back")
        for m in down[1:]:
            m.restart()
        etcd3.wait_healthy(30)
        return True

    def etcd_member_stop(self) -> bool:
        w = self.w
        member = w.rng.choice(self.etcd3.members)
        member.pause()
        f = w.fault("SIGSTOP an etcd member", member=member.name)
        w.sleep(2.0, 4.0)
        member.resume()
        w.healed(f, f"SIGCONT etcd {member.name}")
        self.etcd3.wait_healthy(30)
        return True

    def parked_restarted(self) -> bool:
        w = self.w
        jobs = {c.job for c in self._kind_jobs("--sim-bytes")} | {c.job for c in self._kind_jobs("--coop-regions")}
        parked = wait_for(lambda: w.observer.in_state({"snapshotted"}, jobs), 8)
        job = parked[0][1] if parked else None
        victim = next((c for c in w.live_clients() if c.job == job), None)
        if victim is None:
            return False
        info = w.kill_client(victim)
        f = w.fault("SIGKILL a parked job", **info)
        w.sleep(0.2, 1.0)
        self._again(victim)
        w.healed(f, f"{job} started again under its id")
        return True

    def leader_and_holder(self) -> bool:
        w = self.w
        held = wait_for(lambda: w.holders(), 8)
        leader, epoch = w.lockd_leader()
        leader.kill()
        info = w.kill_client(held[0]) if held else {}
        f = w.fault("SIGKILL lockd leader and a holder together", replica=leader.replica_id, **info)
        w.wait_new_leader(epoch)
        if held:
            _session_gone(w, held[0].job)
        w.healed(f, "new lockd leader, the holder's session gone")
        leader.start()
        if held:
            self._again(held[0])
        return bool(held)

    def raft_stop_and_leader(self) -> bool:
        w, etcd3 = self.w, self.etcd3
        member = etcd3.leader()
        leader, epoch = w.lockd_leader()
        member.pause()
        leader.kill()
        f = w.fault("SIGSTOP etcd raft leader and SIGKILL lockd leader", member=member.name,
                    replica=leader.replica_id)
        w.sleep(2.0, 4.0)
        member.resume()
        self._restart_leader_after(leader, epoch, f, f"SIGCONT etcd {member.name}, new lockd leader")
        etcd3.wait_healthy(30)
        return True

    def agent_and_leader(self) -> bool:
        w, node = self.w, self.node
        coop = {c.job for c in self._kind_jobs("--coop-regions")}
        parked = wait_for(lambda: in_flight(w, "coop_paused", "coop_resuming", coop), 8)
        leader, epoch = w.lockd_leader()
        node.kill_agent()
        leader.kill()
        f = w.fault("SIGKILL node agent (cooperative jobs parked) and lockd leader", paused=parked or "none seen")
        w.sleep(2.0, 3.5)
        node.restart_agent()
        self._restart_leader_after(leader, epoch, f, "node agent restarted, new lockd leader")
        return bool(parked)

    KINDS = ("agent_in_swap", "coop_in_pause", "etcd_majority", "etcd_member_stop", "parked_restarted",
             "leader_and_holder", "raft_stop_and_leader", "agent_and_leader")


def recovery_by_kind(report) -> dict[str, dict]:
    """Per fault kind: how many, and heal -> first grant (any group; slowest group asked for), max and median."""
    out: dict[str, dict] = {}
    for what, first, slowest in report.recoveries:
        d = out.setdefault(what, {"n": 0, "first": [], "slowest": []})
        d["n"] += 1
        d["first"].append(first)
        d["slowest"].append(slowest)

    def fig(xs: list) -> dict:
        got = [x for x in xs if x is not None]
        return {"max_s": max(got) if got else None, "median_s": round(statistics.median(got), 3) if got else None,
                "never": len(xs) - len(got)}
    return {k: {"faults": d["n"], "first_grant": fig(d["first"]), "slowest_group": fig(d["slowest"])}
            for k, d in sorted(out.items())}


def test_long_fault_run(world, etcd3):  # noqa: F811
    w, node = long_world(world, etcd3)
    node.agent.start()
    w.start(duration=DURATION_S)
    faults = Faults(w, node, etcd3)
    order = list(Faults.KINDS)
    w.rng.shuffle(order)                     # every kind at least once, early; then drawn at random
    caught: dict[str, list[bool]] = {}
    i = 0
    while w.remaining() > 20:
        w.sleep(4.0, 9.0)
        kind = order[i] if i < len(order) else w.rng.choice(Faults.KINDS)
        i += 1
        caught.setdefault(kind, []).append(getattr(faults, kind)())
    report = w.finish(grace=60)
    swap_figures(w)
    by_kind = recovery_by_kind(report)
    summary = {"duration_s": round(w.elapsed(), 1), "faults": len(w.faults), "grants": report.grants,
               "violations": len(report.violations), "caught": {k: sum(v) for k, v in caught.items()},
               "tries": {k: len(v) for k, v in caught.items()},
               "memory_not_back": len(report.of_kind("memory-back")),
               "late_first_grant_after_heal": len(report.of_kind("heal")),
               "false_session_losses": len(report.of_kind("session-loss")),
               "recovery_by_fault_kind": by_kind}
    print("  long-run summary: " + json.dumps(summary, indent=1))
    with open(os.path.join(w.dir, "long-run.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    verdict(w, report)
    missed = [k for k in Faults.KINDS if not any(caught.get(k, ()))]
    if LONG:
        assert not missed, f"these fault kinds never caught their moment: {missed}"

