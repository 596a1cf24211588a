"""Chaos scenarios of restarts and stalls, through the public client library (``--library`` clients).

* A job process SIGKILLed while it holds, or while it waits, and started again at
  once under the same job id: the new process waits its predecessor's session out,
  then works; it must never be told its new session is lost while etcd keeps its
  lease alive (checker rule ``session-loss``).
* The replica serving an in-flight Acquire is SIGSTOPped for longer than the
  client's keepalive-ping timeout, and resumed after its clients failed over: it
  then processes attempts the clients abandoned. No acquire may fail for it, and
  every grant must reach a live caller or be released within a bound (checker
  rule ``ghost``, from an observer of the grant keys).

Bounded and seeded like test_scenarios.py (replay with ``CHAOS_SEED``); about a
minute of chaos in all.
"""
from __future__ import annotations

import time

import pytest

from chaos_tests.scenario import SESSION_TTL, repeats
from chaos_tests.test_scenarios import verdict, world  # noqa: F401 - the fixture

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

#: Client keepalive: a ping every second, dropped after one more unanswered (timeslice.config).
PING_TIMEOUT_S = 2.0


def test_job_restarted_under_the_same_id_while_holding_and_while_waiting(world):  # noqa: F811
    w = world("job-restart-same-id", seed=1701, library=True, clients=5).start(duration=26)
    restarted, killed = [], []
    for i in range(repeats(4, 2)):           # holding, waiting, ...
        w.sleep(1.5, 3)
        if i % 2 == 0:
            c, how = w.wait_for_holder(), "holding"
        else:
            c, how = w.wait_for_waiter()[0], "waiting"
        info = w.kill_client(c)
        killed.append(c)
        w.fault(f"SIGKILL job process while {how}; restart it under the same job id", **info)
        restarted.append(w.spawn_client(max(14.0, w.remaining()), job=c.job))
    # Time for the last one to wait out its predecessor's session and work a while (with room for
    # a loaded 2-core CI machine: each restarted process also queues FIFO behind the others).
    time.sleep(2 * SESSION_TTL + 8)
    report = w.finish()
    verdict(w, report)
    # Each restarted process that lived to the end was granted (one the scenario picked again as
    # its next waiter to kill may have been killed before its turn came).
    survivors = [c for c in restarted if c not in killed]
    assert survivors
    for c in survivors:
        got = [e for e in w.client_events(c) if e["ev"] == "granted"]
        assert got, f"the restarted process of {c.job} (pid {c.pid}) was never granted anything"


def test_replica_stalled_under_an_inflight_acquire_past_the_ping_timeout(world):  # noqa: F811
    w = world("replica-stall-inflight-acquire", seed=1702, library=True, clients=6).start(duration=26)
    for _ in range(repeats(3, 2)):
        w.sleep(2, 3)
        c, req = w.wait_for_waiter()
        victim = w.replica_at(req["replica"])
        pause = PING_TIMEOUT_S + w.rng.uniform(2.0, 4.0)
        f = w.fault("SIGSTOP the replica serving an in-flight Acquire", replica=victim.replica_id,
                    job=c.job, pause_s=round(pause, 2))
        victim.pause()
        time.sleep(pause)
        victim.resume()
        w.healed(f, f"SIGCONT {victim.replica_id}")
    report = w.finish()
    verdict(w, report)
    errors = [e for e in w.all_events if e["ev"] == "error"]
    assert errors == [], f"acquire/yield failed for a stall the client should ride through: {errors[:3]}"
    # A paused replica costs no more than a dead one: its clients went elsewhere and were
    # granted while it was still stopped, not only once it woke.
    for f, first in zip(w.faults, w.fault_recoveries(w.all_events)):
        assert first is not None and first < f.t1 - f.t0, (
            f"no grant during the {f.t1 - f.t0:.1f}s stall of {f.detail['replica']} (first after {first}s)")
