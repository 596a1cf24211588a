"""A cooperative worker frozen in place (a strict group's elided handoff) can still be parked
when room is needed later: its pause is CUDA work of its own, so the agent lifts the lock first.
The test process is the cooperative worker (SIMULATED device); intents are written as the leader
writes them."""
from __future__ import annotations

from agenthelpers import NODE, MiB, answered, put

from tests.agent.test_cooperative_channel import SECRET, register, session
from timeslice.common.server import records as R
from timeslice.common.sim.device import SimDevice
from timeslice.cooperative import CooperativeWorker


async def test_a_frozen_cooperative_worker_is_unlocked_for_its_pause_and_resumes_intact(client, keys, agents,
                                                                                       sim_dir):
    from timeslice.sim.coop import SimCooperativeMemory
    agent = agents()
    await session(client, keys, "coop-s")
    mem = SimCooperativeMemory({"weights": (3 * MiB, "offload")}, sim_dir, gbps=0)
    w = CooperativeWorker("coop-s", SECRET, mem, NODE, agent.socket).start()
    dev = SimDevice(sim_dir)

    async def op(op: str, token: int) -> R.StatusValue:
        val = R.IntentValue(op, "coop-s", "g", token, 1, R.now_ms(), isolation=R.ISOLATION_STRICT)
        return await answered(client, keys, NODE, "coop-s", await put(client, keys.intent(NODE, "coop-s"), val.dump()))

    try:
        await register(client, keys, "coop-s", w.pid, {"weights": "offload"})
        st = await op(R.FREEZE, 41)
        assert (st.outcome, st.state, st.bytes) == (R.OK, R.FROZEN, 0)
        assert dev.read_state(w.pid)["state"] == "locked" and dev.held(w.pid) == 4 * MiB   # nothing moved
        st = await op(R.SNAPSHOT, 42)            # room needed after all: strict takes everything, as full does
        assert (st.outcome, st.state) == (R.OK, R.SNAPSHOTTED), st.error
        assert dev.held(w.pid) == 0
        st = await op(R.RESTORE, 43)
        assert (st.outcome, st.state) == (R.OK, R.RUNNING) and dev.held(w.pid) == 4 * MiB
        assert mem.checksum("weights") == mem.expected("weights")
    finally:
        w.close()
        mem.close()
