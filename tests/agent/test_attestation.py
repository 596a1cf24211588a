"""Attestation: the agent acts on a registered pid only for the job whose process proved it over the
node-local channel (the pid itself or an ancestor; nodeagent/attestations.py), whatever RegisterWorker said.

The test process attests as the victim job and starts the victim's SIMULATED worker (its child).
Mallory registers that pid as hers: her snapshot touches nothing and the victim's bytes stay put.
"""
from __future__ import annotations

import subprocess

from agenthelpers import NODE, MiB, answered, intent, register, status
from test_cooperative_channel import SECRET, session

from timeslice.common.server import records as R
from timeslice.cooperative import Attestation, CooperativeWorker


async def test_a_job_cannot_have_another_jobs_process_snapshotted(client, keys, agents, workers):
    agent = agents(extra=["--require-attestation"])
    await session(client, keys, "victim")
    await session(client, keys, "mallory", "mallory-secret")
    me = CooperativeWorker("victim", SECRET, Attestation(), NODE, agent.socket).start()
    try:
        victim = workers(2 * MiB, seed=5)                   # a child of this (attested) process
        await register(client, keys, "mallory", NODE, victim.pid, 2 * MiB)
        rev = await intent(client, keys, NODE, "mallory", R.SNAPSHOT, token=50)
        st = await answered(client, keys, NODE, "mallory", rev)
        assert st.outcome != R.OK or st.state == R.GONE, st   # nothing of hers to act on
        assert st.bytes == 0 and victim.verify()              # untouched, still computing
        [ev] = agent.wait_events("worker_not_attested", 1, job="mallory", pid=victim.pid)
        assert ev["why"] == "attested by another job"         # the other job is not named

        # The victim's own registration is acted on.
        await register(client, keys, "victim", NODE, victim.pid, 2 * MiB)
        rev = await intent(client, keys, NODE, "victim", R.SNAPSHOT, token=51)
        st = await answered(client, keys, NODE, "victim", rev)
        assert (st.outcome, st.state, st.bytes) == (R.OK, R.SNAPSHOTTED, 2 * MiB)
        rev = await intent(client, keys, NODE, "victim", R.RESTORE, token=52)
        assert (await answered(client, keys, NODE, "victim", rev)).state == R.RUNNING
        assert victim.verify()
    finally:
        me.close()


async def test_an_unattested_registration_is_ignored_when_attestation_is_required(client, keys, agents, workers):
    agent = agents(extra=["--require-attestation"])
    await session(client, keys, "lonely")
    # A process outside any attested tree: double-forked, so its parent is gone.
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    pid = int(out.stdout.strip())
    try:
        await register(client, keys, "lonely", NODE, pid, MiB)
        rev = await intent(client, keys, NODE, "lonely", R.SNAPSHOT, token=60)
        await answered(client, keys, NODE, "lonely", rev)
        [ev] = agent.wait_events("worker_not_attested", 1, job="lonely", pid=pid)
        assert ev["why"].startswith("not attested")
        assert (await status(client, keys, NODE, "lonely")).pids == []
    finally:
        subprocess.run(["kill", str(pid)])
