"""Chaos scenarios against etcd itself: members paused, and the majority lost and back.

* SIGSTOP of an etcd follower, then of the raft leader (alive but silent past the election
  timeout: the others elect a new leader; the old one wakes up as a follower);
* the loss of an etcd majority for seconds, two ways: two of three members SIGKILLed
  (then restarted on their data), and two SIGSTOPped (then SIGCONT). While there is no
  quorum the lock must grant nothing (clients wait, or see UNAVAILABLE: checker rule
  ``quorum``, and ``status``: never INTERNAL); once it is back, every group is granted
  again within the recovery bound (``recovery``) and nothing is lost (``lost-waiter``,
  the fence's count of each job's operations).

Raw-gRPC clients on two groups, with the observer of etcd (ghost grants, sessions).
"""
from __future__ import annotations

import time

import pytest

from chaos_tests.test_scenarios import verdict, world  # noqa: F401 - the fixture

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


def test_etcd_member_sigstop_and_majority_loss(world, etcd3):  # noqa: F811
    w = world("etcd-pause-and-quorum-loss", seed=2505, observe=True).start(duration=30)
    for role in ("follower", "raft leader"):
        w.sleep(1.5, 2.5)
        leader = etcd3.leader()
        victim = leader if role == "raft leader" else w.rng.choice(etcd3.followers())
        pause = w.rng.uniform(2.0, 3.0)
        f = w.fault(f"SIGSTOP etcd {role}", member=victim.name, pause_s=round(pause, 2))
        victim.pause()
        time.sleep(pause)
        victim.resume()
        w.healed(f, f"SIGCONT etcd {victim.name}")
        etcd3.wait_healthy(30)
    for how in ("kill", "pause"):
        w.sleep(2, 3)
        span = w.rng.uniform(3.0, 4.5)
        gone = etcd3.lose_quorum(how)
        f = w.fault(f"etcd majority lost ({'SIGKILL' if how == 'kill' else 'SIGSTOP'} of "
                    f"{len(gone)} of {etcd3.size})", no_quorum=True, members=[m.name for m in gone],
                    for_s=round(span, 2))
        time.sleep(span)
        etcd3.regain_quorum(gone)
        w.healed(f, f"etcd members {[m.name for m in gone]} back")
        etcd3.wait_healthy(30)
    report = w.finish()
    verdict(w, report)
