"""Memory a job makes inside its hold (an optimizer's state at its first step) is on the node
agent's report to etcd before the hold ends: ``ModelRegions`` announces the growth with
``sync=True`` and the agent answers only after its report counts it. Without that, the next
grant was planned on a report from before the growth (the agent refreshes every few seconds)
and another job was put on a device that was full (CI: its first optimizer step ran out of
simulated memory). Real etcd, lockd and agent; the job is this test process on the SIMULATED device."""
from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch", reason="needs the test extra (torch)")

from timeslice.common.server import records as R  # noqa: E402
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops  # noqa: E402
from timeslice.common.server.keys import Keys  # noqa: E402
from timeslice.integrations.pytorch import ModelRegions  # noqa: E402
from timeslice.sim.torch_memory import SimTorchMemory  # noqa: E402

NODE = "rl-node"
CTX = 64 << 10


def reported(etcd, key_prefix) -> R.AgentValue:
    async def get():
        async with EtcdClient(EtcdConfig.parse(etcd.endpoints_str)) as c:
            r = await c.range(ops.range_req(Keys(key_prefix).agent(NODE)))
            return R.AgentValue.load(r.kvs[0].value)
    return asyncio.run(get())


def test_a_region_grown_inside_a_hold_is_on_the_agents_report_before_the_hold_ends(rl_stack, etcd, key_prefix):
    jobs, agent = rl_stack(8 << 20, agent_extra=("--refresh-interval", "9"))   # no periodic refresh meanwhile
    from timeslice import OrchestratorClient
    with OrchestratorClient(target=jobs.env["TIMESLICE_TARGET"], job_id="grower") as client:
        client.acquire("rl-gpus", timeout=30)
        mem = SimTorchMemory(sim_dir=jobs.env["TIMESLICE_SIM_DIR"], context_bytes=CTX)
        place = ModelRegions(mem)
        place.module(torch.nn.Linear(64, 64))
        place.worker = client.cooperate(mem, node=NODE, socket_path=agent.socket)
        # The hello made the agent report the job; wait for that report to settle.
        before = None
        for _ in range(200):
            before = reported(etcd, key_prefix).job_device_bytes.get("grower")
            if before:
                break
            time.sleep(0.05)
        assert before == mem.dev.device_bytes, (before, mem.dev.device_bytes)
        state = torch.zeros(256 << 10, dtype=torch.uint8)            # the optimizer's first step: 256 KiB more
        place.adopt("optimizer", [state])
        after = reported(etcd, key_prefix).job_device_bytes.get("grower")   # read at once: no waiting
        assert after == before + (256 << 10) == mem.dev.device_bytes, (before, after)
        mem.close()                                                  # inside the hold, as a job does
        client.yield_("rl-gpus")


def test_a_checkpoint_workers_memory_made_inside_a_hold_is_reported_before_its_yield(
        rl_stack, etcd, key_prefix, monkeypatch):
    # No regions here: the job's process simply allocates inside its hold (an optimizer's first
    # step, a cache). The Yield first has the agent report it (Workers.sync_reports), so the
    # grant lockd plans at that Yield sees the device as it is.
    from timeslice import OrchestratorClient
    from timeslice.sim.runtime import SimDeviceClient
    jobs, agent = rl_stack(8 << 20, agent_extra=("--refresh-interval", "9"))
    monkeypatch.setenv("TIMESLICE_NODE_NAME", NODE)
    monkeypatch.setenv("TIMESLICE_AGENT_SOCKET", agent.socket)
    dev = SimDeviceClient.open(jobs.env["TIMESLICE_SIM_DIR"], gpu=0)
    try:
        with OrchestratorClient(target=jobs.env["TIMESLICE_TARGET"], job_id="ckpt-grower") as client:
            client.register_worker(swap="checkpoint", node=NODE)
            client.acquire("rl-gpus", timeout=30)
            before = reported(etcd, key_prefix).job_device_bytes.get("ckpt-grower", 0)
            dev.alloc(3 << 20)                                       # made inside the hold
            client.yield_("rl-gpus")
            after = reported(etcd, key_prefix).job_device_bytes.get("ckpt-grower", 0)   # at once
            assert (before, after) == (0, 3 << 20)
    finally:
        dev.free()
        dev.close()
