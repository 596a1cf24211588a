"""A job finds `timeslice up`'s cluster as the CLI does, and cannot pass on a simulated device nobody watches.

One local cluster, started the way ``timeslice up`` starts it (the launcher's ``LocalCluster``,
SIMULATED device), with its per-user pointer in a folder of this module's own. A job here
sets nothing but its node name (what ``up`` prints): no ``TIMESLICE_TARGET``, no
``TIMESLICE_SIM_DIR``, no ``TIMESLICE_AGENT_SOCKET``.

* ``up`` prints the simulated device's folder and an ``export`` line for it, and ``--json`` says it;
* the client reaches the cluster's lockd through the pointer (``timeslice.config``) and says so;
* simulated memory opened with no folder is on the cluster's device, and cooperates;
* simulated memory on another folder (the old default, ``/dev/shm/timeslice-sim``, which no
  agent watched) is refused at once when it joins the agent, with both folders named: before,
  such a job ran, was "bit-identical", and nothing was ever swapped.
"""
from __future__ import annotations

import os

import pytest
import structlog.testing

from timeslice import OrchestratorClient, WrongDeviceError
from timeslice.launcher.cli_up import describe, summary
from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.settings import Settings
from timeslice.sim.coop import SimCooperativeMemory
from timeslice.sim.runtime import SimDeviceClient

NODE = "discovery-node"
GROUP = "disc-gpus"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run = tmp_path_factory.mktemp("discovery")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIMESLICE_USER_STATE_DIR", str(run / "user-state"))   # this module's pointer only
        for var in ("TIMESLICE_TARGET", "TIMESLICE_SIM_DIR", "TIMESLICE_AGENT_SOCKET"):
            mp.delenv(var, raising=False)
        mp.setenv("TIMESLICE_NODE_NAME", NODE)
        settings = Settings(etcd_members=1, lockd_replicas=1, backend="sim", sim_device_capacity_bytes=64 << 20)
        c = LocalCluster(settings, run / "run", node=NODE, group=GROUP, progress=lambda _m: None).start()
        try:
            yield c
        finally:
            c.stop(quiet=True)


def test_up_prints_and_reports_the_simulated_device(cluster):
    assert cluster.sim_dir and os.path.isdir(cluster.sim_dir)
    text = summary(cluster, 1.0)
    assert f"export TIMESLICE_SIM_DIR={cluster.sim_dir}" in text
    assert f"in {cluster.sim_dir}" in text                          # on the agent's line too
    doc = describe(cluster)
    assert doc["sim_dir"] == cluster.sim_dir
    assert doc["exports"] == {"TIMESLICE_TARGET": cluster.target, "TIMESLICE_NODE_NAME": NODE,
                              "TIMESLICE_AGENT_SOCKET": str(cluster.run_dir / "agent.sock"),
                              "TIMESLICE_SIM_DIR": cluster.sim_dir}


def test_the_client_reaches_the_local_cluster_with_no_target(cluster):
    with structlog.testing.capture_logs() as logs:
        client = OrchestratorClient(job_id="found-1")
    # it says which target it used, and why (a job with no TIMESLICE_TARGET may reach a cluster or nothing)
    [said] = [e for e in logs if e["event"] == "client_target"]
    assert (said["log_level"], said["source"], said["targets"], said["cluster"]) == (
        "info", "local-cluster", [cluster.target], str(cluster.state_path))
    with client:
        assert client.config.target_source == "local-cluster"
        assert client.config.target_origin == str(cluster.state_path)
        assert client.targets == (cluster.target,)
        grant = client.acquire(GROUP, timeout=30)
        assert grant.token > 0
        client.yield_(GROUP)


def test_simulated_memory_with_no_folder_is_on_the_clusters_device_and_cooperates(cluster):
    mem = SimCooperativeMemory({"weights": (MiB, "offload")}, gbps=0)
    try:
        assert mem.sim_dir() == os.path.realpath(cluster.sim_dir)
        with OrchestratorClient(job_id="found-2") as client:
            worker = client.cooperate(mem)                          # the socket found through the pointer too
            assert worker.pid == os.getpid()
            assert {j.job_id: j for j in client.jobs()}["found-2"].workers == 1
    finally:
        mem.dev.close()


def test_memory_on_a_device_nobody_watches_fails_at_once(cluster, tmp_path):
    elsewhere = tmp_path / "timeslice-sim"                          # what the old default was: no agent on it
    mem = SimCooperativeMemory({"weights": (MiB, "offload")}, sim_dir=elsewhere, gbps=0)
    try:
        with OrchestratorClient(job_id="unwatched-1") as client:
            with pytest.raises(WrongDeviceError) as e:
                client.cooperate(mem)
            text = str(e.value)
            assert str(elsewhere) in text and cluster.sim_dir in text
            assert "nothing this job does there would be seen or swapped" in text
            assert f"TIMESLICE_SIM_DIR={cluster.sim_dir}" in text
            assert {j.job_id: j for j in client.jobs()}.get("unwatched-1") is None or \
                {j.job_id: j for j in client.jobs()}["unwatched-1"].workers == 0   # nothing registered
    finally:
        mem.dev.close()


def test_a_checkpointed_worker_on_a_device_nobody_watches_fails_too(cluster, tmp_path):
    """The attestation a checkpoint-swapped worker opens checks the process's open simulated devices."""
    dev = SimDeviceClient.open(tmp_path / "elsewhere")
    try:
        dev.alloc(MiB)
        with OrchestratorClient(job_id="unwatched-2") as client:
            with pytest.raises(WrongDeviceError):
                client.register_worker(device_bytes=MiB)
    finally:
        dev.close()
