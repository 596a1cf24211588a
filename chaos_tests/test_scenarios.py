"""Chaos scenarios (issue 7 §3–4): faults against real processes, judged by the history checker.

Each scenario runs a 3-member etcd, 3 lockd replicas and several client
processes (``client_proc.py``) looping acquire → fenced critical section →
yield on two groups, injects its faults on a seeded schedule, then merges
every process's history and asserts the checker found no violation and
that enough grants happened to mean something. Figures are printed (run
with ``-s``) and kept in the test's tmp dir (``figures.txt``, ``history/``,
``logs/``). Replay a failing schedule with ``CHAOS_SEED=<seed>``.
"""
from __future__ import annotations

import os
import time

import pytest

from chaos_tests.scenario import LEASE_TTL, SESSION_TTL, World, scenario_seed

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

MIN_GRANTS = 20


@pytest.fixture
def world(etcd3, key_prefix, tmp_path, proc_reaper, request):
    """Makes the scenario's World; on the way out stops lockd, and on failure shows the logs."""
    made: list[World] = []

    def make(name: str, seed: int, **kw) -> World:
        w = World(etcd3, key_prefix, tmp_path, proc_reaper, seed=scenario_seed(seed), name=name, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        if request.node.rep_call_failed if hasattr(request.node, "rep_call_failed") else False:
            print(w.lockd.dump_logs(80))
        w.stop()


def verdict(w: World, report) -> None:
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.grants > MIN_GRANTS, f"only {report.grants} grants: the scenario proved little"


def test_lockd_leader_sigkill_repeatedly(world):
    """SIGKILL the lockd leader three times (restarting it each time): no waiter is lost."""
    w = world("lockd-leader-kill", seed=101).start(duration=24)
    for _ in range(3):
        w.sleep(3, 5)
        leader, epoch = w.lockd_leader()
        f = w.fault("SIGKILL lockd leader", replica=leader.replica_id, epoch=epoch)
        leader.kill()
        new, new_epoch = w.wait_new_leader(epoch)
        w.healed(f, f"new leader {new.replica_id} epoch {new_epoch}")
        w.sleep(0.5, 1.5)
        leader.start()                          # same port: clients find it again
    verdict(w, w.finish())


def test_lockd_leader_sigstop_past_its_lease(world):
    """SIGSTOP the leader for longer than its lease, then SIGCONT: it must not grant on waking."""
    w = world("lockd-leader-pause", seed=202).start(duration=26)
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
