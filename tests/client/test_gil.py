"""A swap request runs with the interpreter's switch interval lowered (timeslice.gil), and puts it back.

Why it matters: beside a busy main thread each GIL-dropping call of a pause waits a
whole switch interval to get the GIL back; on the H200 a 6 GB pause took 5.1 s
instead of 0.18 s beside a TRL reward function (timeslice/gil.py has the figures).
"""
from __future__ import annotations

import sys
import threading

import pytest

from timeslice import gil
from timeslice.common import frames as F
from timeslice.cooperative import CallbackMemory, CooperativeWorker


def worker_seeing(seen: list) -> CooperativeWorker:
    mem = CallbackMemory(pause=lambda: seen.append(("pause", sys.getswitchinterval())),
                         resume=lambda: seen.append(("resume", sys.getswitchinterval())), nbytes=1 << 20)
    return CooperativeWorker("job-a", "s", mem, node="n0", socket_path="/nonexistent")


def test_pause_and_resume_run_with_a_short_switch_interval_and_put_it_back():
    before = sys.getswitchinterval()
    assert before > gil.SWAP_SWITCH_INTERVAL_S
    seen: list = []
    w = worker_seeing(seen)
    assert w.handle({"type": F.PAUSE, "id": 1, "tags": None})["ok"]
    assert w.handle({"type": F.RESUME, "id": 2})["ok"]
    assert [k for k, _ in seen] == ["pause", "resume"]
    assert all(v <= gil.SWAP_SWITCH_INTERVAL_S for _, v in seen), seen
    assert sys.getswitchinterval() == before


def test_a_failed_pause_puts_the_interval_back_too():
    before = sys.getswitchinterval()

    def boom():
        raise RuntimeError("device lost")
    w = CooperativeWorker("job-a", "s", CallbackMemory(pause=boom, resume=lambda: None, nbytes=1),
                          node="n0", socket_path="/nonexistent")
    done = w.handle({"type": F.PAUSE, "id": 1, "tags": None})
    assert not done["ok"] and done["code"] == "INTERNAL"
    assert sys.getswitchinterval() == before


def test_nested_and_concurrent_uses_restore_the_outermost_value():
    before = sys.getswitchinterval()
    inner_started, release = threading.Event(), threading.Event()

    def other():
        with gil.prompt_handoff():
            inner_started.set()
            release.wait(5)

    with gil.prompt_handoff():
        t = threading.Thread(target=other)
        t.start()
        assert inner_started.wait(5)
    # the first user left while the second still runs: still short
    assert sys.getswitchinterval() <= gil.SWAP_SWITCH_INTERVAL_S
    release.set()
    t.join(5)
    assert sys.getswitchinterval() == before


def test_an_interval_already_shorter_is_left_alone():
    interval = 1e-5
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        with gil.prompt_handoff():
            assert sys.getswitchinterval() == pytest.approx(interval)
        assert sys.getswitchinterval() == pytest.approx(interval)
    finally:
        sys.setswitchinterval(before)
