"""The channel's lobby (sans-IO): who is evicted when connections waiting for a hello pass a bound."""
from __future__ import annotations

import pytest

from timeslice.nodeagent.lobby import Lobby


def test_a_newcomer_is_always_seated_and_a_process_past_its_bound_loses_its_oldest():
    lobby = Lobby(per_pid=3, per_uid=10, total=20)
    first = [lobby.enter(100, 1)[0] for _ in range(3)]
    seat, out = lobby.enter(100, 1)
    assert out == [first[0]] and first[0].evicted and "pid 100" in first[0].why
    assert lobby.waiting(pid=100) == 3 and lobby.seats()[-1] is seat


def test_a_user_past_its_bound_loses_the_oldest_of_its_busiest_process_never_a_lone_worker():
    lobby = Lobby(per_pid=6, per_uid=6, total=100)
    worker, _ = lobby.enter(7, 1000)                 # the real worker came first: the oldest of all
    flood = [lobby.enter(8, 1000)[0] for _ in range(5)]
    for i in range(50):                              # the flooder keeps coming, from two processes
        seat, out = lobby.enter(8 + i % 2, 1000)
        assert len(out) == 1 and out[0] is not worker and out[0].pid in (8, 9), out
    assert not worker.evicted and lobby.waiting(uid=1000) == 6
    assert flood[0].evicted and "uid 1000" in flood[0].why


def test_past_the_total_the_busiest_user_loses():
    lobby = Lobby(per_pid=4, per_uid=4, total=6)
    quiet = lobby.enter(1, 500)[0]
    loud = [lobby.enter(10 + i, 600)[0] for i in range(4)]
    other = lobby.enter(20, 700)[0]
    _seat, out = lobby.enter(21, 700)                # 7th: someone of uid 600 goes, its oldest
    assert out == [loud[0]] and "6 connections" in loud[0].why
    assert not quiet.evicted and not other.evicted and len(lobby) == 6


def test_leaving_frees_the_place_and_is_idempotent():
    lobby = Lobby(per_pid=2, per_uid=2, total=2)
    a, _ = lobby.enter(1, 1)
    lobby.leave(a)
    lobby.leave(a)
    assert len(lobby) == 0 and lobby.waiting(uid=1) == 0
    b, out = lobby.enter(1, 1)
    c, out2 = lobby.enter(1, 1)
    assert out == out2 == [] and lobby.evictions == 0


def test_bounds_must_nest():
    with pytest.raises(ValueError):
        Lobby(per_pid=10, per_uid=5, total=100)
