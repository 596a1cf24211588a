"""App-endpoint swappers (vLLM sleep mode, SGLang release/resume) against the SIMULATED
inference server: real processes, real bytes on the simulated device, capacity enforced."""
from __future__ import annotations

import socket
import threading

import pytest
from inference_helpers import SimServer
from simhelpers import MiB

from timeslice.common.device_errors import ProcessGone
from timeslice.common.server.records import WorkerValue
from timeslice.nodeagent.backends.app_endpoint import (
    SglangSwapper,
    SwapConfigError,
    SwapNotVerified,
    VllmSwapper,
    make_app_swapper,
)
from timeslice.nodeagent.backends.swapper import SwapRefused, SwapState, SwapTimeout
from timeslice.nodeagent.sim.meter import SimMeter

VLLM_REGIONS = ["weights=8MiB:offload", "kv_cache=4MiB:discard"]
SGL_REGIONS = ["weights=8MiB:offload", "kv_cache=4MiB:discard", "cuda_graph=2MiB:discard"]


@pytest.fixture
def servers(sim_dir, sim):
    started: list[SimServer] = []

    def _start(flavor: str, regions: list[str], **kw) -> SimServer:
        s = SimServer(sim_dir, flavor, regions, **kw)
        started.append(s)
        return s

    yield _start
    for s in started:
        s.stop()


@pytest.fixture
def meter(sim):
    return SimMeter(sim.dev)


def worker(srv: SimServer, swap: str, tags: dict | None = None) -> WorkerValue:
    return WorkerValue(pid=srv.pid, node="n1", swap=swap, endpoint=srv.url, tags=tags or {})


def test_vllm_level1_offloads_weights_and_brings_them_back_bit_exact(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm"), meter)
    assert isinstance(sw, VllmSwapper) and sw.level == 1
    assert sum(meter.usage(srv.pid).values()) == 13 * MiB
    assert sw.state() is SwapState.RUNNING

    rep = sw.pause(None, deadline_s=5)
    assert rep.device_bytes == 12 * MiB           # measured on the device, not claimed by the server
    assert sum(meter.usage(srv.pid).values()) == 1 * MiB   # the context stays
    assert sw.state() is SwapState.PAUSED and sw.paused_bytes() == 12 * MiB
    mem = srv.memory()["regions"]
    assert mem["weights"]["offloaded"] and not mem["kv_cache"]["offloaded"]

    back = sw.resume(deadline_s=5)
    assert back.device_bytes == 12 * MiB
    assert sw.state() is SwapState.RUNNING and sw.paused_bytes() is None
    mem = srv.memory()["regions"]
    assert mem["weights"]["resident"] and mem["weights"]["matches_fill"] and mem["weights"]["intact"]
    # Idempotent: resuming a running worker moves nothing.
    assert sw.resume(deadline_s=5).device_bytes == 0


def test_vllm_level2_from_registration_discards_weights(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm", {"weights": "discard"}), meter)
    assert sw.level == 2
    rep = sw.pause(None, deadline_s=5)
    assert rep.device_bytes == 12 * MiB and rep.bytes_moved == 0 and sw.host_bytes() == 0
    assert not srv.memory()["regions"]["weights"]["offloaded"]
    sw.resume(deadline_s=5)
    assert srv.memory()["regions"]["weights"]["intact"] is False


def test_sglang_moves_only_the_registered_tags(servers, meter):
    srv = servers("sglang", SGL_REGIONS)
    sw = make_app_swapper(worker(srv, "sglang", {"kv_cache": "discard", "cuda_graph": "discard"}), meter)
    assert isinstance(sw, SglangSwapper)
    rep = sw.pause(None, deadline_s=5)
    assert sorted(rep.tags) == ["cuda_graph", "kv_cache"]
    assert rep.device_bytes == 6 * MiB and rep.bytes_moved == 0
    regions = srv.memory()["regions"]
    assert regions["weights"]["resident"] and not regions["kv_cache"]["resident"]
    assert sw.state() is SwapState.PAUSED
    sw.resume(deadline_s=5)
    assert sum(meter.usage(srv.pid).values()) == 15 * MiB


def test_sglang_without_tags_releases_everything_and_offloads_weights(servers, meter):
    srv = servers("sglang", SGL_REGIONS)
    sw = make_app_swapper(worker(srv, "sglang"), meter)
    rep = sw.pause(None, deadline_s=5)
    assert rep.device_bytes == 14 * MiB and rep.tags == []
    assert srv.memory()["regions"]["weights"]["offloaded"]
    sw.resume(deadline_s=5)
    assert srv.memory()["regions"]["weights"]["matches_fill"]


def test_transient_503_is_retried_within_the_deadline(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    srv.post("/sim/fault", {"status": 503, "count": 3})
    rep = make_app_swapper(worker(srv, "vllm"), meter).pause(None, deadline_s=10)
    assert rep.device_bytes == 12 * MiB


def test_503_past_the_deadline_is_a_timeout_and_releases_nothing(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    srv.post("/sim/fault", {"status": 503, "count": 10_000})
    with pytest.raises(SwapTimeout):
        make_app_swapper(worker(srv, "vllm"), meter).pause(None, deadline_s=0.5)
    assert sum(meter.usage(srv.pid).values()) == 13 * MiB


def test_non_transient_error_fails_at_once(servers, meter):
    srv = servers("sglang", SGL_REGIONS)   # a vLLM swapper against a server without /sleep: 404
    sw = make_app_swapper(WorkerValue(pid=srv.pid, node="n1", swap="vllm", endpoint=srv.url), meter)
    with pytest.raises(SwapRefused, match="HTTP 404"):
        sw.pause(None, deadline_s=30)


def test_connection_refused_during_a_restart_is_retried(servers, sim_dir):
    with socket.socket() as s:        # a port nobody listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started: list[SimServer] = []
    t = threading.Timer(0.3, lambda: started.append(servers("vllm", VLLM_REGIONS, port=port)))
    t.start()
    # The worker pid is this (live) process; the meter is left out: this is about the retry.
    sw = VllmSwapper(WorkerValue(pid=__import__("os").getpid(), node="n1", swap="vllm",
                                 endpoint=f"http://127.0.0.1:{port}"), None)
    rep = sw.pause(None, deadline_s=60)     # room for the server's start on a loaded machine
    t.join()
    assert rep.detail["verified"] is False and started[0].memory()["regions"]["weights"]["offloaded"]


def test_dead_server_is_process_gone(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm"), meter)
    srv.stop()
    with pytest.raises(ProcessGone):
        sw.pause(None, deadline_s=2)
    assert sw.state() is SwapState.GONE


def test_server_that_answers_without_releasing_is_not_verified(servers, meter):
    srv = servers("vllm", VLLM_REGIONS)
    srv.post("/sim/fault", {"lie": True})
    sw = make_app_swapper(worker(srv, "vllm"), meter)
    with pytest.raises(SwapNotVerified):
        sw.pause(None, deadline_s=0.5)
    assert sum(meter.usage(srv.pid).values()) == 13 * MiB and sw.paused_bytes() is None


def test_slow_server_is_a_timeout(servers, meter):
    srv = servers("sglang", SGL_REGIONS)
    srv.post("/sim/fault", {"delay_s": 3})
    with pytest.raises(SwapTimeout):
        make_app_swapper(worker(srv, "sglang"), meter).pause(None, deadline_s=0.3)


def test_resume_that_does_not_fit_is_refused_and_keeps_the_host_copy(servers, meter, spawn):
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm"), meter)
    sw.pause(None, deadline_s=5)
    hog = spawn(60 * MiB)          # the device (64 MiB) is now full
    with pytest.raises(SwapRefused, match="HTTP 500"):
        sw.resume(deadline_s=5)
    assert srv.memory()["regions"]["weights"]["offloaded"]
    hog.stop()
    sw.resume(deadline_s=5)
    assert srv.memory()["regions"]["weights"]["matches_fill"]


def test_a_backend_serves_as_the_meter(servers, sim):
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm"), sim)         # the agent passes its checkpoint backend
    assert sw.pause(None, deadline_s=5).device_bytes == 12 * MiB
    assert sw.resume(deadline_s=5).detail["verified"]


@pytest.mark.parametrize("w, match", [
    (WorkerValue(pid=1, node="n", swap="checkpoint", endpoint="http://x:1"), "no app-endpoint swapper"),
    (WorkerValue(pid=1, node="n", swap="vllm", endpoint="ftp://x"), "http"),
    (WorkerValue(pid=1, node="n", swap="vllm", endpoint="http://u:p@x:1"), "credentials"),
    (WorkerValue(pid=1, node="n", swap="vllm", endpoint="http://x:1", tags={"kv_cache": "offload"}), "KV"),
    (WorkerValue(pid=1, node="n", swap="vllm", endpoint="http://x:1", tags={"lora": "offload"}), "tags"),
])
def test_bad_registration_is_a_config_error(w, match):
    with pytest.raises(SwapConfigError, match=match):
        make_app_swapper(w, None)


def test_pause_then_checkpoint_what_is_left_and_back(servers, meter, sim):
    """Full isolation: the server releases its regions, the checkpoint backend takes the context."""
    srv = servers("vllm", VLLM_REGIONS)
    sw = make_app_swapper(worker(srv, "vllm"), meter)
    sw.pause(None, deadline_s=5)
    sim.lock(srv.pid, 1000)
    assert sim.checkpoint(srv.pid) == 1 * MiB                 # only the context was left
    assert meter.usage(srv.pid) == {}
    sim.restore(srv.pid)
    sim.unlock(srv.pid)
    back = sw.resume(deadline_s=5)
    assert back.device_bytes == 12 * MiB
    assert srv.memory()["regions"]["weights"]["matches_fill"]


def test_resume_waits_while_the_context_is_checkpointed(servers, meter, sim):
    srv = servers("sglang", SGL_REGIONS)
    sw = make_app_swapper(worker(srv, "sglang"), meter)
    sw.pause(None, deadline_s=5)
    sim.lock(srv.pid, 1000)
    sim.checkpoint(srv.pid)
    with pytest.raises(SwapTimeout):                         # its "CUDA calls" block until restored
        sw.resume(deadline_s=0.5)
    assert sw.state() is SwapState.PAUSED and sum(meter.usage(srv.pid).values()) == 0
    sim.restore(srv.pid)
    sim.unlock(srv.pid)
    # The timed-out call may finish on the server once it runs again; a retried resume
    # must then find the memory back rather than call it unverified.
    rep = sw.resume(deadline_s=5)
    assert rep.detail["verified"] and sum(meter.usage(srv.pid).values()) == 15 * MiB
    assert srv.memory()["regions"]["weights"]["matches_fill"] and sw.state() is SwapState.RUNNING
