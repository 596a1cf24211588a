"""Drain before sleep: the app-endpoint swappers quiesce the SIMULATED inference server
before releasing its memory, with generate requests really in flight.

The stand-in crashes, as vLLM and SGLang do, when its memory is released under a
running request; so each test first shows what the swapper must avoid, or checks that
every request it let run finished normally."""
from __future__ import annotations

import urllib.error

import pytest
from inference_helpers import Request, SimServer
from simhelpers import MiB, wait_until

from timeslice.common.server.records import WorkerValue
from timeslice.nodeagent.backends.app_endpoint import SwapConfigError, make_app_swapper
from timeslice.nodeagent.backends.swapper import SwapTimeout
from timeslice.nodeagent.sim.meter import SimMeter

REGIONS = ["weights=8MiB:offload", "kv_cache=4MiB:discard"]


@pytest.fixture
def server(sim_dir, sim):
    started: list[SimServer] = []

    def _start(flavor: str, token_ms: float = 5.0) -> SimServer:
        s = SimServer(sim_dir, flavor, REGIONS, token_ms=token_ms)
        started.append(s)
        return s

    yield _start
    for s in started:
        s.stop()


def swapper(srv: SimServer, sim, **kw):
    w = WorkerValue(pid=srv.pid, node="n1", swap=srv.ready["flavor"], endpoint=srv.url)
    return make_app_swapper(w, SimMeter(sim.dev), **kw)


def running(srv: SimServer, n: int) -> bool:
    return srv.requests()["running"] >= n


@pytest.mark.parametrize("flavor, sleep", [("vllm", "/sleep?level=1"), ("sglang", "/release_memory_occupation")])
def test_the_stand_in_crashes_when_slept_under_a_request(server, flavor, sleep):
    srv = server(flavor)
    req = Request(srv, tokens=2000)
    assert wait_until(lambda: running(srv, 1), timeout=10)
    with pytest.raises(urllib.error.HTTPError, match="500"):
        srv.post(sleep, {})
    assert req.finish_reason().startswith("HTTP 500")
    state = srv.requests()
    assert "in flight" in state["crashed"] and state["failed"] == 1
    with pytest.raises(urllib.error.HTTPError, match="500"):
        srv.get("/health")


def test_vllm_waits_for_in_flight_requests_then_sleeps(server, sim):
    srv = server("vllm")
    reqs = [Request(srv, tokens=40 + 20 * i) for i in range(3)]
    assert wait_until(lambda: running(srv, 3), timeout=10)
    sw = swapper(srv, sim)
    rep = sw.pause(None, deadline_s=20)
    assert [r.finish_reason() for r in reqs] == ["length"] * 3    # drained, none failed or cut
    assert rep.device_bytes == 12 * MiB and rep.detail["drain_ms"] > 0
    # While it sleeps the server admits nothing: a new request is held, not failed.
    late = Request(srv, tokens=5)
    assert wait_until(lambda: srv.requests()["held"] == 1, timeout=10)
    assert srv.get("/is_paused")["is_paused"] is True
    sw.resume(deadline_s=10)
    assert late.finish_reason() == "length"
    state = srv.requests()
    assert state["crashed"] == "" and state["failed"] == 0 and state["completed"] == 4
    assert srv.get("/is_paused")["is_paused"] is False


def test_sglang_retracts_running_requests_and_they_continue_after_the_resume(server, sim):
    srv = server("sglang")
    reqs = [Request(srv, tokens=400) for _ in range(2)]           # ~2 s each: still running at the pause
    assert wait_until(lambda: running(srv, 2), timeout=10)
    sw = swapper(srv, sim)
    rep = sw.pause(None, deadline_s=20)
    assert rep.device_bytes == 12 * MiB
    state = srv.requests()
    assert state["retracted"] == 2 and state["crashed"] == ""
    sw.resume(deadline_s=10)
    for r in reqs:
        status, doc = r.result()
        assert status == 200 and doc["meta_info"]["completion_tokens"] == 400
    assert srv.requests()["failed"] == 0


def test_vllm_drain_deadline_refuses_and_keeps_serving(server, sim):
    srv = server("vllm", token_ms=20)
    req = Request(srv, tokens=100)                                 # ~2 s: outlives the 0.3 s drain
    assert wait_until(lambda: running(srv, 1), timeout=10)
    sw = swapper(srv, sim, drain_s=0.3)
    with pytest.raises(SwapTimeout, match="still in flight"):
        sw.pause(None, deadline_s=20)
    assert sum(SimMeter(sim.dev).usage(srv.pid).values()) == 13 * MiB   # nothing released
    assert srv.get("/is_paused")["is_paused"] is False                  # generation resumed
    assert req.finish_reason() == "length"
    assert srv.requests()["crashed"] == ""


def test_vllm_drain_deadline_with_abort_policy_aborts_then_sleeps(server, sim):
    srv = server("vllm", token_ms=20)
    req = Request(srv, tokens=500)                                 # ~10 s
    assert wait_until(lambda: running(srv, 1), timeout=10)
    sw = swapper(srv, sim, drain_s=0.3, on_drain_timeout="abort")
    rep = sw.pause(None, deadline_s=20)
    assert rep.detail["aborted_in_flight"] is True and rep.device_bytes == 12 * MiB
    assert req.finish_reason() == "abort"
    state = srv.requests()
    assert state["crashed"] == "" and state["aborted"] == 1
    sw.resume(deadline_s=10)
    assert Request(srv, tokens=3).finish_reason() == "length"


@pytest.mark.parametrize("kw, match", [({"drain_s": 0}, "drain_s"), ({"on_drain_timeout": "x"}, "on_drain")])
def test_bad_drain_settings_are_config_errors(kw, match):
    w = WorkerValue(pid=1, node="n", swap="vllm", endpoint="http://x:1")
    with pytest.raises(SwapConfigError, match=match):
        make_app_swapper(w, None, **kw)
