"""The agent loop against real etcd, a real agent process and real workers on the SIMULATED device.

Intents are written as the leader writes them (IntentValue, a plain put); the
statuses are read back as the leader reads them (answered when
intent_revision == the intent's mod_revision and outcome != "").
"""
from __future__ import annotations

from agenthelpers import NODE, MiB, agent_value, answered, intent, register, wait_agent, wait_status

from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.sim import SimBackend


async def test_snapshot_restore_round_trip_with_checksums(client, keys, agents, workers, sim_dir):
    agents()
    w = workers(4 * MiB, seed=7)
    await register(client, keys, "job-a", NODE, w.pid, 4 * MiB)
    await wait_agent(client, keys, NODE, lambda a: a.job_device_bytes.get("job-a") == 4 * MiB)

    rev = await intent(client, keys, NODE, "job-a", R.SNAPSHOT, token=10)
    st = await answered(client, keys, NODE, "job-a", rev)
    assert (st.state, st.outcome, st.op, st.token, st.group) == (R.SNAPSHOTTED, R.OK, R.SNAPSHOT, 10, "g")
    assert st.bytes == st.device_bytes == 4 * MiB and st.pids == [w.pid] and st.elapsed_ms > 0
    # The liveness key written with the status already shows the freed device.
    a = await agent_value(client, keys, NODE)
    assert a.device_free_bytes == a.device_total_bytes == 64 * MiB and "job-a" not in a.job_device_bytes
    assert SimBackend(sim_dir).get_state(w.pid) is ProcState.CHECKPOINTED

    # Idempotent: the same order again is answered without moving anything.
    rev = await intent(client, keys, NODE, "job-a", R.SNAPSHOT, token=10)
    st = await answered(client, keys, NODE, "job-a", rev)
    assert (st.state, st.outcome, st.bytes, st.device_bytes) == (R.SNAPSHOTTED, R.OK, 0, 4 * MiB)

    rev = await intent(client, keys, NODE, "job-a", R.RESTORE, token=10)
    st = await answered(client, keys, NODE, "job-a", rev)
    assert (st.state, st.outcome, st.bytes) == (R.RUNNING, R.OK, 4 * MiB)
    assert w.verify()
    a = await agent_value(client, keys, NODE)
    assert a.device_free_bytes == 60 * MiB and a.job_device_bytes == {"job-a": 4 * MiB}

    rev = await intent(client, keys, NODE, "job-a", R.RESTORE, token=11)
    st = await answered(client, keys, NODE, "job-a", rev)
    assert (st.state, st.outcome, st.bytes) == (R.RUNNING, R.OK, 0)


async def test_a_job_of_several_processes_moves_together(client, keys, agents, workers):
    agents()
    ws = [workers(3 * MiB, seed=s) for s in (1, 2, 3)]
    for w in ws:
        await register(client, keys, "job-m", NODE, w.pid, 3 * MiB)
    rev = await intent(client, keys, NODE, "job-m", R.SNAPSHOT, token=5)
    st = await answered(client, keys, NODE, "job-m", rev)
    assert (st.state, st.bytes, st.pids) == (R.SNAPSHOTTED, 9 * MiB, sorted(w.pid for w in ws))
    rev = await intent(client, keys, NODE, "job-m", R.RESTORE, token=5)
    assert (await answered(client, keys, NODE, "job-m", rev)).state == R.RUNNING
    assert all(w.verify() for w in ws)


async def test_stale_token_is_refused_and_remembered_across_restart(client, keys, agents, workers, tmp_path):
    agent = agents()
    w = workers(2 * MiB)
    await register(client, keys, "job-s", NODE, w.pid)
    rev = await intent(client, keys, NODE, "job-s", R.SNAPSHOT, token=20)
    assert (await answered(client, keys, NODE, "job-s", rev)).state == R.SNAPSHOTTED

    rev = await intent(client, keys, NODE, "job-s", R.RESTORE, token=15)
    st = await answered(client, keys, NODE, "job-s", rev)
    assert (st.outcome, st.state, st.token) == (R.REFUSED, R.SNAPSHOTTED, 20)   # the fencing token
    assert "stale_token" in st.error and "token 15" in st.error
    assert agent.wait_event("intent_refused", job="job-s", token=15)["reason"] == st.error

    # A new agent, without its local state file, recovers the book from its statuses in etcd.
    agent.stop()
    fresh = agents(state_dir=tmp_path / "other-state")
    rev = await intent(client, keys, NODE, "job-s", R.RESTORE, token=18)
    st = await answered(client, keys, NODE, "job-s", rev)
    assert st.outcome == R.REFUSED and "stale_token" in st.error
    assert fresh.events("agent_started")[-1]["tokens"] == {"g": 20}
    # The same token, and a newer one, are acted on; another group has its own book.
    rev = await intent(client, keys, NODE, "job-s", R.RESTORE, token=20)
    assert (await answered(client, keys, NODE, "job-s", rev)).outcome == R.OK
    rev = await intent(client, keys, NODE, "job-s", R.SNAPSHOT, token=3, group="other")
    assert (await answered(client, keys, NODE, "job-s", rev)).outcome == R.OK
    rev = await intent(client, keys, NODE, "job-s", R.RESTORE, token=21)
    assert (await answered(client, keys, NODE, "job-s", rev)).outcome == R.OK
    assert w.verify()


async def test_a_slow_stale_completion_cannot_overwrite_a_newer_intent(client, keys, agents, workers):
    # 8 MiB at 8 MB/s: the snapshot takes about a second.
    agent = agents(extra=["--sim-checkpoint-gbps", "0.008"])
    w = workers(8 * MiB, seed=3)
    await register(client, keys, "job-x", NODE, w.pid)
    first = await intent(client, keys, NODE, "job-x", R.SNAPSHOT, token=30)
    await wait_status(client, keys, NODE, "job-x", lambda s: s.state == R.SNAPSHOTTING)
    newer = await intent(client, keys, NODE, "job-x", R.RESTORE, token=30)

    st = await answered(client, keys, NODE, "job-x", newer, timeout=15)
    assert (st.op, st.state, st.outcome, st.bytes) == (R.RESTORE, R.RUNNING, R.OK, 8 * MiB)
    ev = agent.wait_event("status_superseded", intent_revision=first)
    assert ev["outcome"] == R.OK and ev["newer_revision"] == newer
    # Never, at any point, did a status answer the replaced intent.
    assert not agent.events("op_done", intent_revision=first, written=True)
    assert w.verify()


async def test_snapshot_refused_when_host_memory_is_short(client, keys, agents, workers):
    agents(extra=["--host-reserve-bytes", str(1 << 60)])
    w = workers(4 * MiB)
    await register(client, keys, "job-h", NODE, w.pid)
    rev = await intent(client, keys, NODE, "job-h", R.SNAPSHOT, token=2)
    st = await answered(client, keys, NODE, "job-h", rev)
    assert (st.outcome, st.state, st.bytes) == (R.REFUSED, R.RUNNING, 0)
    assert "host memory" in st.error
    assert (await agent_value(client, keys, NODE)).host_free_bytes == 0
    assert w.ask("steps").startswith("STEPS") and w.verify()       # untouched, still computing


async def test_restore_refused_when_the_device_has_no_room(client, keys, agents, workers):
    agents()
    a = workers(40 * MiB, seed=1)
    await register(client, keys, "job-a", NODE, a.pid)
    rev = await intent(client, keys, NODE, "job-a", R.SNAPSHOT, token=1)
    assert (await answered(client, keys, NODE, "job-a", rev)).state == R.SNAPSHOTTED
    b = workers(40 * MiB, seed=2)                          # takes the room back
    rev = await intent(client, keys, NODE, "job-a", R.RESTORE, token=1)
    st = await answered(client, keys, NODE, "job-a", rev)
    assert (st.outcome, st.state, st.device_bytes) == (R.REFUSED, R.SNAPSHOTTED, 40 * MiB)
    assert "device" in st.error
    b.stop()                                               # room again: the context was not lost
    rev = await intent(client, keys, NODE, "job-a", R.RESTORE, token=1)
    assert (await answered(client, keys, NODE, "job-a", rev)).state == R.RUNNING
    assert a.verify()


async def test_lock_timeout_fails_the_snapshot_and_leaves_the_job_running(client, keys, agents, workers):
    agents(extra=["--lock-timeout-ms", "150"])
    w = workers(2 * MiB)
    await register(client, keys, "job-l", NODE, w.pid)
    assert w.ask("hold 800") == "HOLDING"
    rev = await intent(client, keys, NODE, "job-l", R.SNAPSHOT, token=4)
    st = await answered(client, keys, NODE, "job-l", rev)
    assert (st.outcome, st.state) == (R.FAILED, R.RUNNING) and "NOT_READY" in st.error
    assert w.read(5) == "HELD" and w.verify()


async def test_processes_gone_are_reported_gone(client, keys, agents, workers):
    agents()
    w = workers(2 * MiB)
    await register(client, keys, "job-g", NODE, w.pid)
    w.kill()
    rev = await intent(client, keys, NODE, "job-g", R.SNAPSHOT, token=6)
    st = await answered(client, keys, NODE, "job-g", rev)
    assert (st.outcome, st.state, st.pids) == (R.PROCESS_GONE, R.GONE, [])
    # A job never registered here is gone too, not an error.
    rev = await intent(client, keys, NODE, "job-none", R.RESTORE, token=6)
    assert (await answered(client, keys, NODE, "job-none", rev)).outcome == R.PROCESS_GONE


async def test_a_snapshotted_job_that_dies_is_corrected_to_gone(client, keys, agents, workers):
    agents(extra=["--refresh-interval", "0.2"])
    w = workers(2 * MiB)
    await register(client, keys, "job-d", NODE, w.pid)
    rev = await intent(client, keys, NODE, "job-d", R.SNAPSHOT, token=8)
    assert (await answered(client, keys, NODE, "job-d", rev)).state == R.SNAPSHOTTED
    w.kill()
    st = await wait_status(client, keys, NODE, "job-d", lambda s: s.state == R.GONE)
    assert (st.intent_revision, st.outcome) == (rev, R.OK)       # the answer itself is kept


async def test_different_jobs_are_moved_concurrently(client, keys, agents, workers):
    # 8 MiB at 8 MB/s: about a second each; together they overlap instead of queueing.
    agent = agents(extra=["--sim-checkpoint-gbps", "0.008"])
    ws = {job: workers(8 * MiB, seed=i) for i, job in enumerate(("job-1", "job-2"))}
    for job, w in ws.items():
        await register(client, keys, job, NODE, w.pid)
    revs = {job: await intent(client, keys, NODE, job, R.SNAPSHOT, token=9) for job in ws}
    for job, rev in revs.items():
        assert (await answered(client, keys, NODE, job, rev, timeout=20)).state == R.SNAPSHOTTED
    started = {e["job"]: e["timestamp"] for e in agent.wait_events("op_started", 2)}
    done = {e["job"]: e["timestamp"] for e in agent.wait_events("op_done", 2)}
    assert max(started.values()) < min(done.values())       # ISO timestamps compare in time order
