"""A vLLM / SGLang sampler moved by lockd + the agent through its HTTP API, end to end
(SIMULATED device and SIMULATED inference server; real etcd, lockd and agent processes).

The sampler (41 MiB on a 64 MiB device) and a trainer (40 MiB) do not fit together:
the trainer's acquire makes the agent put the server to sleep (vLLM ``/sleep?level=1``,
SGLang ``/release_memory_occupation``; the weights to host memory) once a request
still in flight has drained, the trainer allocates in the room that made; when the sampler
acquires again the trainer is checkpointed and the server woken, its weights bit-exact.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from timeslice import OrchestratorClient
from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.settings import Settings
from timeslice.sim.runtime import SimDeviceClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nodeagent"))
from inference_helpers import Request, SimServer
from simhelpers import wait_until

MiB = 1 << 20


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    s = Settings(etcd_members=1, lockd_replicas=1, backend="sim", sim_device_capacity_bytes=64 * MiB,
                 sim_snapshot_bytes_per_s=0, sim_restore_bytes_per_s=0)
    # Both jobs' clients live in this process, whose child is the sampler's server: the process
    # cannot attest for two jobs, so it attests for none (no agent at that socket) and the agent
    # does not require attestation, as the harness's agents do not.
    monkeypatch.setenv("TIMESLICE_AGENT_SOCKET", str(tmp_path / "no-agent-here.sock"))
    c = LocalCluster(s, tmp_path / "run", node="n1", group="g", progress=lambda _m: None,
                     sim_dir=str(tmp_path / "sim"), require_attestation=False).start()
    yield c
    c.stop(quiet=True)


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_sampler_sleeps_for_the_trainer_and_wakes_bit_exact(cluster, flavor):
    srv = SimServer(Path(cluster.sim_dir), flavor, ["weights=24MiB:offload", "kv_cache=16MiB:discard"])
    try:
        with OrchestratorClient(cluster.target, job_id="sampler", timeout=30) as sampler, \
                OrchestratorClient(cluster.target, job_id="trainer", timeout=30) as trainer:
            sampler.acquire("g", timeout=30, device_bytes_hint=41 * MiB)
            sampler.register_worker(pid=srv.pid, node="n1", device_bytes=41 * MiB, swap=flavor,
                                    endpoint=srv.url, tags={"weights": "offload", "kv_cache": "discard"})
            sampler.yield_("g")
            # A request still in flight (another client of the server): the agent must drain
            # it before the sleep, or the server dies as the real ones do.
            straggler = Request(srv, tokens=60)
            assert wait_until(lambda: srv.requests()["running"] == 1, timeout=10)

            g = trainer.acquire("g", timeout=60, device_bytes_hint=40 * MiB)
            if flavor == "vllm":     # vLLM: finished before the sleep; SGLang: retracted, continues later
                assert straggler.finish_reason() == "length"
            else:
                assert srv.requests()["retracted"] == 1
            assert srv.requests()["crashed"] == ""
            mem = srv.memory()
            assert not mem["regions"]["weights"]["resident"] and mem["regions"]["weights"]["offloaded"]
            assert mem["device_bytes"] == 1 * MiB and g.restored is False
            dev = SimDeviceClient.open(cluster.sim_dir)      # the trainer's memory: fits only now
            dev.alloc(40 * MiB)
            trainer.register_worker(node="n1", device_bytes=40 * MiB)
            trainer.yield_("g")

            back = sampler.acquire("g", timeout=60, device_bytes_hint=41 * MiB)
            assert back.restored is True
            assert straggler.finish_reason() == "length" and srv.requests()["failed"] == 0
            weights = srv.memory()["regions"]["weights"]
            assert weights["resident"] and weights["matches_fill"]
            sampler.yield_("g")
            st = sampler.status("g")
            states = {j.job_id: j.state for n in st.node_status for j in n.jobs}
            assert states.get("trainer") == "snapshotted"
    finally:
        srv.stop()
