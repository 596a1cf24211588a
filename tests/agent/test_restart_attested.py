"""The agent restarted (SIGKILL, then started again as ``timeslice up`` starts it) in the configuration
users get: attestation required (``--require-attestation``, as ``timeslice up`` and deploy/ run the
agent), the default reconnect grace and refresh timings, and jobs that attest themselves through the
public client (a cooperative job's channel; a checkpoint job's ``register_worker``), reconnecting on
their own timing, never held back by the test.

One SIMULATED GPU of 32 MiB, a cooperative job C of 20 MiB (1 MiB context + 12 MiB offloaded + 7 MiB
discarded) and a checkpoint job K of 20 MiB: they never fit side by side. After the restart, the
workers are not back on the new agent's channel yet; the agent must neither plan them as absent nor
grant either job with its memory not back. Checked at each grant: the job's memory is on the device
(a checkpoint job's process running with its arena whole; a cooperative job's regions resumed and
bit-exact), and the other job's allocation fits (the one before it really went).
"""
from __future__ import annotations

import pytest
from agenthelpers import NODE, MiB, get, status, wait_agent
from jobhelpers import CkptProc, Job, wait_for

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops

COOP = f"weights:{12 * MiB}:offload,kv:{7 * MiB}:discard"
FOOT = 20 * MiB
CAPACITY = 32 * MiB
ATTESTED = ["--require-attestation"]       # timeslice up's agent (launcher/start.py::agent_child)

pytestmark = pytest.mark.timeout(240)


def coop(n, sim_dir) -> Job:
    return Job(n.lockd.replicas[0].target, "coop-c", sim_dir, n.agent.socket, COOP)


def ckpt(n, sim_dir) -> CkptProc:
    return CkptProc(n.lockd.replicas[0].target, "ckpt-k", sim_dir, FOOT,
                    env={"TIMESLICE_AGENT_SOCKET": n.agent.socket})


def restart(n) -> None:
    n.agent.kill()
    n.agent.start()


async def c_resident(n, client, keys, sim_dir) -> Job:
    c = coop(n, sim_dir)
    assert c(f"acquire g {FOOT}")["ok"] and c("write weights 0badcafe")["ok"]
    assert c("yield g")["deferred"]
    await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("coop-c") == FOOT)
    return c


async def k_resident(n, client, keys, sim_dir) -> CkptProc:
    k = ckpt(n, sim_dir)
    g = k(f"acquire g {FOOT}")
    assert g["ok"] and g["alloc"] == "ok" and g["back"], g
    assert k("yield g")["deferred"]
    await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("ckpt-k") == FOOT)
    return k


def c_back(c: Job) -> None:
    g = c(f"acquire g {FOOT}")
    assert g["ok"] and g["restored"], g
    assert c("verify weights")["match"] and c("verify kv")["match"], "C's regions are not back"
    assert c("yield g")["ok"]


def k_back(k: CkptProc, first: bool = False) -> None:
    g = k(f"acquire g {FOOT}")
    assert g["ok"] and g["back"], g
    if first:
        assert g["alloc"] == "ok", f"K's allocation did not fit: the job before it was left on the device: {g}"
    else:
        assert g["restored"] and k("verify")["match"], g
    assert k("yield g")["ok"]


async def test_a_resident_cooperative_job_is_paused_for_the_checkpoint_job_after_an_agent_restart(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        c = await c_resident(n, client, keys, sim_dir)
        k = ckpt(n, sim_dir)
        try:
            restart(n)
            g = k(f"acquire g {FOOT}")
            assert g["ok"] and g["bytes_moved"] == 12 * MiB, f"C's memory was not moved out for K: {g}"
            assert g["alloc"] == "ok" and g["back"], f"K's allocation did not fit beside C: {g}"
            assert k("yield g")["ok"]
            c_back(c)
        finally:
            c.kill()
            k.kill()


async def test_a_parked_cooperative_job_is_resumed_before_its_grant_after_an_agent_restart(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        c = await c_resident(n, client, keys, sim_dir)
        k = ckpt(n, sim_dir)
        try:
            k_back(k, first=True)                           # C paused for K; K stays resident
            assert (await status(client, keys, NODE, "coop-c")).state == R.SNAPSHOTTED
            restart(n)
            c_back(c)                                       # never restored=False on released regions
            k_back(k)
        finally:
            c.kill()
            k.kill()


async def test_a_resident_checkpoint_job_is_snapshotted_for_the_cooperative_job_after_an_agent_restart(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        k = await k_resident(n, client, keys, sim_dir)
        c = coop(n, sim_dir)
        try:
            restart(n)
            g = c(f"acquire g {FOOT}")                      # C's first grant: its regions go on the device
            assert g["ok"] and g["bytes_moved"] == FOOT, f"K's memory was not moved out for C: {g}"
            assert (await status(client, keys, NODE, "ckpt-k")).state == R.SNAPSHOTTED, \
                "C was granted while K's 20 MiB were on the device"
            assert c("write weights 0badcafe")["ok"] and c("yield g")["ok"]
            k_back(k)
            c_back(c)
        finally:
            c.kill()
            k.kill()


async def test_a_parked_checkpoint_job_is_restored_before_its_grant_after_an_agent_restart(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        k = await k_resident(n, client, keys, sim_dir)
        c = coop(n, sim_dir)
        try:
            g = c(f"acquire g {FOOT}")                      # K checkpointed for C; C stays resident
            assert g["ok"] and c("write weights 0badcafe")["ok"] and c("yield g")["ok"]
            assert (await status(client, keys, NODE, "ckpt-k")).state == R.SNAPSHOTTED
            restart(n)
            k_back(k)                                       # never granted while checkpointed
            c_back(c)
        finally:
            c.kill()
            k.kill()


# --- the agent down longer than its lease: the agent before it left no word in etcd ------------

async def restart_after_its_lease(n, client, keys) -> None:
    """SIGKILL, then start only once etcd has dropped the dead agent's lease (its liveness key and the
    attestations it wrote): the new agent learns whose each process is only from the workers."""
    n.agent.kill()
    await wait_for(lambda: _gone(client, keys.agent(NODE)), 30, "the dead agent's lease expired")
    assert not (await client.range(ops.range_req(keys.attestations(NODE), prefix=True))).kvs
    n.agent.start()


async def _gone(client, key: bytes) -> bool:
    return await get(client, key) is None


async def test_a_resident_cooperative_job_is_paused_for_the_checkpoint_job_after_a_restart_past_the_lease(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        c = await c_resident(n, client, keys, sim_dir)
        k = ckpt(n, sim_dir)
        try:
            await restart_after_its_lease(n, client, keys)
            g = k(f"acquire g {FOOT}")
            assert g["ok"] and g["bytes_moved"] == 12 * MiB, f"C's memory was not moved out for K: {g}"
            assert g["alloc"] == "ok" and g["back"], f"K's allocation did not fit beside C: {g}"
            assert k("yield g")["ok"]
            c_back(c)
        finally:
            c.kill()
            k.kill()


async def test_a_parked_checkpoint_job_is_restored_before_its_grant_after_a_restart_past_the_lease(
        keys, client, lockd_node, sim_dir):
    async with lockd_node(CAPACITY, agent_extra=ATTESTED) as n:
        k = await k_resident(n, client, keys, sim_dir)
        c = coop(n, sim_dir)
        try:
            g = c(f"acquire g {FOOT}")                      # K checkpointed for C; C stays resident
            assert g["ok"] and c("write weights 0badcafe")["ok"] and c("yield g")["ok"]
            await restart_after_its_lease(n, client, keys)
            k_back(k)
            c_back(c)
        finally:
            c.kill()
            k.kill()
