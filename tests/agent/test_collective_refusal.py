"""Collective state decides which backend may touch a job: a worker registered
``collective=True`` (CUDA IPC / NCCL peer-to-peer) is never driver-checkpointed. The agent
refuses the snapshot with the reason before touching anything; a cooperative one is not refused
here (its backend moves it)."""
from __future__ import annotations

from agenthelpers import NODE, MiB, answered, intent, put, wait_agent

from timeslice.common.server import records as R
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.nodeagent.picture import Picture


def test_only_checkpointed_collective_workers_are_refused():
    plain = R.WorkerValue(1, NODE)
    coll = R.WorkerValue(2, NODE, collective=True)
    coop = R.WorkerValue(3, NODE, collective=True, swap=R.SWAP_COOPERATIVE)
    assert I.checkpoint_refusal([plain, coop]) == ""
    why = I.checkpoint_refusal([plain, coll, coop])
    assert "pid(s) 2 " in why and "NCCL_P2P_DISABLE=1" in why and "cooperative" in why
    many = I.checkpoint_refusal([R.WorkerValue(p, NODE, collective=True) for p in range(100, 120)])
    assert "and 12 more" in many and len(many) < 600           # bounded, whatever the pid count

    snap = I.Intent("j", 5, R.IntentValue(R.SNAPSHOT, "j", "g", 9, 1))
    rest = I.Intent("j", 5, R.IntentValue(R.RESTORE, "j", "g", 9, 1))
    running, parked = Picture({2: ProcState.RUNNING}, {2: 5}), Picture({2: ProcState.CHECKPOINTED}, {2: 5})
    assert I.decide(snap, running, refusal=why) == I.IntentDecision(I.REFUSE, R.REFUSED, why)
    assert I.decide(rest, parked, refusal=why).kind == I.RUN           # bringing a job back is always allowed
    assert I.decide(snap, parked, refusal=why).outcome == R.OK         # nothing to do is not a refusal


async def test_agent_refuses_to_checkpoint_a_collective_worker_and_touches_nothing(client, keys, agents, workers,
                                                                                   sim_dir):
    agents()
    w = workers(4 * MiB, seed=3)
    await put(client, keys.worker("job-c", NODE, w.pid),
              R.WorkerValue(w.pid, NODE, 4 * MiB, R.now_ms(), collective=True).dump())
    await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("job-c") == 4 * MiB)
    rev = await intent(client, keys, NODE, "job-c", R.SNAPSHOT, token=10)
    st = await answered(client, keys, NODE, "job-c", rev)
    assert (st.state, st.outcome) == (R.RUNNING, R.REFUSED)
    assert "collective" in st.error and "NCCL_P2P_DISABLE=1" in st.error
    assert SimBackend(sim_dir).get_state(w.pid) is ProcState.RUNNING and w.verify()
