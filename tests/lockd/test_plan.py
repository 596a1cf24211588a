"""The swap planner, sans-IO: hand-made states in, actions out."""
from aetcd import rpc

from timeslice.common import swaps
from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.lockd import plan as P
from timeslice.lockd.index import GroupState, JobState, NodeState

GB = 1 << 30


def kv(key, value, create=1, mod=None, lease=0):
    return rpc.KeyValue(key=key.encode(), value=value if isinstance(value, bytes) else value.dump(),
                        create_revision=create, mod_revision=mod or create, lease=lease)


def group(queue, grant=None, nodes=("n1",)):
    gs = GroupState(spec=kv("spec", R.GroupSpec([{"node": n, "gpus": []} for n in nodes])))
    for job, tok, hint in queue:
        gs.queue[job] = kv(f"q/{job}", R.QueueValue(job, 100 + tok, hint), create=tok, lease=100 + tok)
    if grant:
        job, tok = grant
        gs.grant = kv("grant", R.GrantValue(job, tok, 7))
    return gs


def agent(free, total=80 * GB, jobs=None):
    return kv("agent", R.AgentValue("n1", "sim", device_total_bytes=total, device_free_bytes=free,
                                    job_device_bytes=jobs or {}))


def workers(*jobs, node="n1"):
    return {j: JobState(session=kv("s", b"{}"), workers={(node, 1000 + i): kv("w", R.WorkerValue(1000 + i, node))})
            for i, j in enumerate(jobs)}


def status(job, state, outcome="", intent_rev=0, token=0, bytes_=0, device_bytes=0, error=""):
    return kv(f"st/{job}", R.StatusValue(state, job, outcome=outcome, intent_revision=intent_rev,
                                         token=token, bytes=bytes_, device_bytes=device_bytes, error=error))


def intent(job, op, token, mod, issued_ms=1000):
    return kv(f"in/{job}", R.IntentValue(op, job, "g", token, 7, issued_ms), create=mod, mod=mod)


def test_idle_and_held_groups_need_nothing():
    assert P.plan_group(group([]), {}, {}, 0) == []
    assert P.plan_group(group([("A", 5, 0)], grant=("A", 5)), {}, {}, 0) == []


def test_stale_grant_is_dropped_before_anything_else():
    acts = P.plan_group(group([("B", 9, 0)], grant=("A", 5)), {}, {}, 0)
    assert len(acts) == 1 and isinstance(acts[0], P.DropGrant) and acts[0].job == "A"


def test_no_workers_means_plain_grant():
    acts = P.plan_group(group([("B", 9, 0), ("C", 11, 0)]), {}, {}, 0)
    assert acts == [P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]


def test_resident_other_job_and_unknown_footprint_is_snapshotted():
    nodes = {"n1": NodeState(agent=agent(free=70 * GB))}
    acts = P.plan_group(group([("B", 9, 0)]), nodes, workers("A"), 0)
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]


def test_fits_beside_resident_job_is_elided():
    nodes = {"n1": NodeState(agent=agent(free=40 * GB))}
    acts = P.plan_group(group([("B", 9, 10 * GB)]), nodes, workers("A"), 0)
    assert acts == [P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_does_not_fit_evicts_then_restores_then_grants():
    jobs = workers("A", "B")
    ns = NodeState(agent=agent(free=5 * GB), statuses={"B": status("B", R.SNAPSHOTTED, device_bytes=30 * GB)})
    nodes = {"n1": ns}
    # 1. B is snapshotted and needs 30 GB; only 5 free: evict A.
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 0) == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]
    # 2. Intent written, no report yet: wait.
    ns.intents["A"] = intent("A", R.SNAPSHOT, 9, mod=20)
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 2000) == []
    # 3. A snapshotted (answering the intent): restore B.
    ns.statuses["A"] = status("A", R.SNAPSHOTTED, R.OK, intent_rev=20, token=9, bytes_=25 * GB)
    ns.agent = agent(free=75 * GB)
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 2000) == [P.WriteIntent("n1", "B", R.RESTORE, 9, 0)]
    # 4. B restored: grant, with the bytes of both ops.
    ns.intents["B"] = intent("B", R.RESTORE, 9, mod=22)
    ns.statuses["B"] = status("B", R.RUNNING, R.OK, intent_rev=22, token=9, bytes_=30 * GB)
    acts = P.plan_group(group([("B", 9, 0)]), nodes, jobs, 3000)
    assert acts == [P.WriteGrant("B", 9, 109, restored=True, elided=False, bytes_moved=55 * GB)]


def test_snapshotted_job_needs_room_for_its_peak_not_just_its_snapshot():
    ns = NodeState(agent=agent(free=10 * GB), statuses={"B": status("B", R.SNAPSHOTTED, device_bytes=8 * GB)})
    jobs = workers("A", "B")
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0) == [P.WriteIntent("n1", "B", R.RESTORE, 9, 0)]
    assert P.plan_group(group([("B", 9, 12 * GB)]), {"n1": ns}, jobs, 0) == [
        P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]


def test_failed_snapshot_fails_the_waiter_with_reason():
    ns = NodeState(agent=agent(free=1 * GB), intents={"A": intent("A", R.SNAPSHOT, 9, mod=20)},
                   statuses={"A": status("A", R.RUNNING, R.FAILED, intent_rev=20, token=9, error="lock timed out")})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 2000)
    assert len(acts) == 1 and isinstance(acts[0], P.FailWaiter)
    assert acts[0].job == "B" and "lock timed out" in acts[0].reason and acts[0].node == "n1"


def test_stale_report_is_not_taken_for_the_current_intent():
    ns = NodeState(agent=agent(free=1 * GB), intents={"A": intent("A", R.SNAPSHOT, 9, mod=25)},
                   statuses={"A": status("A", R.SNAPSHOTTED, R.OK, intent_rev=20, token=9)})
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 2000) == []


def test_silent_agent_times_out():
    ns = NodeState(agent=agent(free=1 * GB), intents={"A": intent("A", R.SNAPSHOT, 9, mod=20, issued_ms=1000)})
    pol = P.Policy(swap_timeout_ms=5000)
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 5999, pol) == []
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 6001, pol)
    assert isinstance(acts[0], P.FailWaiter) and "did not report" in acts[0].reason


def test_dead_agent_fails_waiter_when_something_must_move():
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": NodeState()}, workers("A"), 0)
    assert isinstance(acts[0], P.FailWaiter) and "not alive" in acts[0].reason


def test_dead_agent_fails_waiter_while_a_status_says_memory_may_be_on_the_node():
    """The agent-kill chaos run: with the agent dead, C (its session replaced while its process lived on,
    so no registration) still had its memory on the device, and a new job was granted onto a full device;
    and a parked job whose session was replaced would be granted with its memory not back."""
    # A's last status: running here, though A has no registration (its session was replaced).
    ns = NodeState(statuses={"A": status("A", R.RUNNING, R.OK)})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers(), 0)
    assert isinstance(acts[0], P.FailWaiter) and "not alive" in acts[0].reason
    # The head's own memory parked here, unregistered: not back, and nobody to bring it back.
    ns = NodeState(statuses={"B": status("B", R.SNAPSHOTTED, R.OK, device_bytes=GB)})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers(), 0)
    assert isinstance(acts[0], P.FailWaiter) and "not alive" in acts[0].reason
    # Gone, or another job parked (its memory off the device): nothing stands in the way.
    ns = NodeState(statuses={"A": status("A", R.GONE, R.PROCESS_GONE), "C": status("C", R.SNAPSHOTTED, R.OK)})
    assert [type(a) for a in P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers(), 0)] == [P.WriteGrant]


def test_gone_processes_are_not_residents():
    ns = NodeState(agent=agent(free=1 * GB), statuses={"A": status("A", R.GONE, R.PROCESS_GONE)})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 0)
    assert acts == [P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]


def test_already_issued_intent_is_not_rewritten_and_older_one_is_replaced():
    ns = NodeState(agent=agent(free=1 * GB), intents={"A": intent("A", R.SNAPSHOT, 3, mod=15)},
                   statuses={"A": status("A", R.RUNNING, R.OK, intent_rev=15, token=3)})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 0)
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 15)]


def test_two_nodes_both_must_settle():
    jobs = {"A": JobState(workers={("n1", 1): kv("w", R.WorkerValue(1, "n1")),
                                   ("n2", 2): kv("w", R.WorkerValue(2, "n2"))})}
    nodes = {"n1": NodeState(agent=agent(free=1 * GB)), "n2": NodeState(agent=agent(free=1 * GB))}
    acts = P.plan_group(group([("B", 9, 0)], nodes=("n1", "n2")), nodes, jobs, 0)
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0), P.WriteIntent("n2", "A", R.SNAPSHOT, 9, 0)]


def test_refused_restore_evicts_residents_then_retries_once():
    jobs = workers("A", "B")
    ns = NodeState(agent=agent(free=50 * GB),
                   intents={"B": intent("B", R.RESTORE, 9, mod=20)},
                   statuses={"B": status("B", R.SNAPSHOTTED, R.REFUSED, intent_rev=20, token=9,
                                         device_bytes=8 * GB, error="no room on gpu0")})
    nodes = {"n1": ns}
    # A was left resident (elision looked possible): evict it rather than fail B.
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 0) == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]
    ns.intents["A"] = intent("A", R.SNAPSHOT, 9, mod=24)
    ns.statuses["A"] = status("A", R.SNAPSHOTTED, R.OK, intent_rev=24, token=9, bytes_=5 * GB)
    # Evicted since the refusal: re-issue the restore (over the refused intent).
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 0) == [P.WriteIntent("n1", "B", R.RESTORE, 9, 20)]
    # Refused again after the eviction (memory of an exiting process, say): wait, retry
    # after a pause, and fail B with the agent's reason once it has waited the swap timeout.
    ns.intents["B"] = intent("B", R.RESTORE, 9, mod=30)
    st = R.StatusValue(R.SNAPSHOTTED, "B", outcome=R.REFUSED, intent_revision=30, token=9, device_bytes=8 * GB,
                       error="no room on gpu0", updated_ms=10_000)
    ns.statuses["B"] = kv("st/B", st)
    pol = P.Policy(swap_timeout_ms=60_000, refused_retry_ms=2_000)
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 11_000, pol) == []
    assert P.plan_group(group([("B", 9, 0)]), nodes, jobs, 12_500, pol) == [
        P.WriteIntent("n1", "B", R.RESTORE, 9, 30)]
    acts = P.plan_group(group([("B", 9, 0)]), nodes, jobs, 61_000, pol)
    assert isinstance(acts[0], P.FailWaiter) and "no room on gpu0" in acts[0].reason


def test_free_memory_counts_registered_bytes_the_agent_has_not_seen_yet():
    jobs = {"A": JobState(workers={("n1", 1): kv("w", R.WorkerValue(1, "n1", device_bytes=30 * GB))})}
    nodes = {"n1": NodeState(agent=agent(free=40 * GB, jobs={"A": 2 * GB}))}
    # The report says 40 GB free, but A registered 28 GB more than it counted: 12 GB really free.
    acts = P.plan_group(group([("B", 9, 20 * GB)]), nodes, jobs, 0)
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]
    # 8 GB declared: admitted with its context, margin and a first hold's spare, 10.7 GB, fits in 12.
    acts = P.plan_group(group([("B", 9, 8 * GB)]), nodes, jobs, 0)
    assert acts == [P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]


def test_never_grants_while_a_node_still_needs_a_move_even_if_its_intent_exists():
    # A resident whose snapshot intent was answered "ok" but whose state still says running
    # (an agent bug or a stale read): the planner must wait, not grant beside it.
    ns = NodeState(agent=agent(free=1 * GB), intents={"A": intent("A", R.SNAPSHOT, 9, mod=20)},
                   statuses={"A": status("A", R.RUNNING, R.OK, intent_rev=20, token=9)})
    assert P.plan_group(group([("B", 9, 10 * GB)]), {"n1": ns}, workers("A"), 0) == []


def test_index_knows_which_groups_serve_a_node_as_specs_come_and_go():
    from timeslice.common.server.etcd.watch import DELETE, PUT, WatchEvent
    from timeslice.common.server.keys import Keys
    from timeslice.lockd.index import StateIndex

    keys = Keys("/t/")
    idx = StateIndex(keys)

    def ev(kind, key, value=b""):
        return WatchEvent(kind, rpc.KeyValue(key=key, value=value, create_revision=1, mod_revision=1), None)

    spec = lambda *ns: R.GroupSpec([{"node": n, "gpus": []} for n in ns]).dump()  # noqa: E731
    idx.apply([ev(PUT, keys.spec("g1"), spec("n1", "n2")), ev(PUT, keys.spec("g2"), spec("n2"))])
    assert idx.groups_on_node("n2") == ["g1", "g2"] and idx.groups_on_node("n1") == ["g1"]
    idx.apply([ev(PUT, keys.spec("g1"), spec("n3"))])
    assert idx.groups_on_node("n1") == [] and idx.groups_on_node("n3") == ["g1"]
    idx.apply([ev(DELETE, keys.spec("g2"))])
    assert idx.groups_on_node("n2") == []


# --- per GPU ----------------------------------------------------------------------------------

def agent4(free, job_gpus=None, job_bytes=None, total=80 * GB):
    """An agent on a node with len(free) GPUs (uuid gpu<k>), as it reports per job and per GPU."""
    gpus = [{"index": i, "uuid": f"gpu{i}", "total_bytes": total, "free_bytes": f} for i, f in enumerate(free)]
    return kv("agent", R.AgentValue("n1", "sim", gpus=gpus, device_total_bytes=total * len(free),
                                    device_free_bytes=sum(free), job_device_bytes=job_bytes or {},
                                    job_gpus=job_gpus or {}))


def group_gpus(queue, gpus, node="n1"):
    gs = group(queue)
    gs.spec = kv("spec", R.GroupSpec([{"node": node, "gpus": list(gpus)}]))
    return gs


def worker_on(job, pid, gpus=(), node="n1", nbytes=0):
    return {(node, pid): kv("w", R.WorkerValue(pid, node, nbytes, gpus=list(gpus)))}


def snap(job, gpu_bytes, total=None):
    return kv(f"st/{job}", R.StatusValue(R.SNAPSHOTTED, job, device_bytes=total or sum(gpu_bytes.values()),
                                         gpu_bytes=gpu_bytes))


def test_one_gpu_full_three_empty_is_planned_per_gpu_not_by_the_node_sum():
    # A fills GPU 0; GPUs 1-3 are empty: 240 GB free on the node, none on GPU 0.
    jobs = {"A": JobState(session=kv("s", b"{}"), workers=worker_on("A", 1)),
            "B": JobState(session=kv("s", b"{}"), workers=worker_on("B", 2))}
    a_rep = {"A": {"gpu0": 80 * GB}}
    # B was checkpointed from GPU 0: its restore lands there, so A must go first.
    ns = NodeState(agent=agent4([0, 80 * GB, 80 * GB, 80 * GB], a_rep, {"A": 80 * GB}),
                   statuses={"B": snap("B", {"gpu0": 30 * GB})})
    g = group_gpus([("B", 9, 0)], [0, 1, 2, 3])
    assert P.plan_group(g, {"n1": ns}, jobs, 0) == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]
    # B was checkpointed from GPU 1: it fits beside A, nothing of A moves.
    ns.statuses["B"] = snap("B", {"gpu1": 30 * GB})
    assert P.plan_group(g, {"n1": ns}, jobs, 0) == [P.WriteIntent("n1", "B", R.RESTORE, 9, 0)]


def test_four_processes_one_per_gpu_need_room_on_each_of_their_gpus():
    # B: 4 processes, one per GPU, 20 GB each, snapshotted; A: 70 GB on GPU 2 only.
    jobs = {"A": JobState(workers=worker_on("A", 1)), "B": JobState(workers={
        **worker_on("B", 10), **worker_on("B", 11), **worker_on("B", 12), **worker_on("B", 13)})}
    ns = NodeState(agent=agent4([80 * GB, 80 * GB, 10 * GB, 80 * GB], {"A": {"gpu2": 70 * GB}}),
                   statuses={"B": snap("B", {f"gpu{i}": 20 * GB for i in range(4)})})
    assert P.plan_group(group_gpus([("B", 9, 0)], []), {"n1": ns}, jobs, 0) == [
        P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]


def test_groups_sharing_a_node_but_not_gpus_never_evict_each_other():
    # PX holds gA (GPU 0) and runs there; PY acquires gB (GPU 1, same node), no hint.
    jobs = {"PX": JobState(session=kv("s", b"{}"), workers=worker_on("PX", 1, gpus=[0])),
            "PY": JobState(session=kv("s", b"{}"), workers=worker_on("PY", 2, gpus=[1]))}
    ns = NodeState(agent=agent4([40 * GB, 80 * GB], {"PX": {"gpu0": 40 * GB}, "PY": {"gpu1": 0}}))
    held = {"PX": [R.GroupSpec([{"node": "n1", "gpus": [0]}])]}
    acts = P.plan_group(group_gpus([("PY", 9, 0)], [1]), {"n1": ns}, jobs, 0, holding=lambda j: held.get(j, []))
    assert acts == [P.WriteGrant("PY", 9, 109, restored=False, elided=False, bytes_moved=0)]


def test_a_holder_is_never_snapshotted_on_its_groups_devices_the_head_waits():
    # PX holds gA (GPU 0) but also has a process on GPU 1, where PY (gB) must make room.
    jobs = {"PX": JobState(session=kv("s", b"{}"), workers={**worker_on("PX", 1), **worker_on("PX", 3)}),
            "PY": JobState(session=kv("s", b"{}"), workers=worker_on("PY", 2))}
    ns = NodeState(agent=agent4([40 * GB, 10 * GB], {"PX": {"gpu0": 40 * GB, "gpu1": 70 * GB}}))
    held = {"PX": [R.GroupSpec([{"node": "n1", "gpus": [0]}])]}
    g = group_gpus([("PY", 9, 30 * GB)], [1])
    assert P.plan_group(g, {"n1": ns}, jobs, 0, holding=lambda j: held.get(j, [])) == []
    # Once PX yields gA it is an ordinary resident again.
    assert P.plan_group(g, {"n1": ns}, jobs, 0, holding=lambda j: []) == [
        P.WriteIntent("n1", "PX", R.SNAPSHOT, 9, 0)]


def test_a_worker_without_device_context_is_not_resident_and_never_blocks():
    # A registered a CPU-only pid (or registered before CUDA init): the agent looked
    # at it and lists it with no device. Nothing to snapshot; B is granted at once.
    ns = NodeState(agent=agent4([80 * GB], {"A": {}}, {"A": 0}))
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]
    # Even after a snapshot intent was answered "ok, running" (a hang seen before this rule).
    ns.intents["A"] = intent("A", R.SNAPSHOT, 9, mod=20)
    ns.statuses["A"] = status("A", R.RUNNING, R.OK, intent_rev=20, token=9)
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A"), 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]


def test_a_job_the_agent_has_not_seen_yet_is_where_its_workers_say_else_everywhere():
    ns = NodeState(agent=agent4([80 * GB, 80 * GB, 80 * GB]))
    declared = {"A": JobState(workers=worker_on("A", 1, gpus=[2]))}
    g = group_gpus([("B", 9, 0)], [0, 1])
    assert P.plan_group(g, {"n1": ns}, declared, 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=False, bytes_moved=0)]
    unknown = {"A": JobState(workers=worker_on("A", 1))}
    assert P.plan_group(g, {"n1": ns}, unknown, 0) == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]


def test_a_snapshot_without_a_per_gpu_record_must_fit_on_every_gpu_it_may_use():
    jobs = {"A": JobState(workers=worker_on("A", 1)), "B": JobState(workers=worker_on("B", 2))}
    ns = NodeState(agent=agent4([5 * GB, 80 * GB], {"A": {"gpu0": 75 * GB}}),
                   statuses={"B": status("B", R.SNAPSHOTTED, device_bytes=30 * GB)})   # no gpu_bytes
    assert P.plan_group(group_gpus([("B", 9, 0)], []), {"n1": ns}, jobs, 0) == [
        P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]


def test_index_knows_which_groups_a_job_holds():
    from timeslice.common.server.etcd.watch import DELETE, PUT, WatchEvent
    from timeslice.common.server.keys import Keys
    from timeslice.lockd.index import StateIndex

    keys = Keys("/t/")
    idx = StateIndex(keys)

    def ev(kind, key, value=b""):
        return WatchEvent(kind, rpc.KeyValue(key=key, value=value, create_revision=1, mod_revision=1), None)

    spec = R.GroupSpec([{"node": "n1", "gpus": [0]}])
    idx.apply([ev(PUT, keys.spec("gA"), spec.dump()), ev(PUT, keys.grant("gA"), R.GrantValue("PX", 5, 1).dump())])
    assert idx.specs_held_by("PX") == [spec] and idx.specs_held_by("PY") == []
    assert idx.specs_held_by("PX", released=("PX", "gA")) == []
    idx.apply([ev(PUT, keys.grant("gA"), R.GrantValue("PY", 7, 1).dump())])
    assert idx.specs_held_by("PX") == [] and idx.specs_held_by("PY") == [spec]
    idx.apply([ev(DELETE, keys.grant("gA"))])
    assert idx.specs_held_by("PY") == [] and idx.job_grants == {}


def test_others_are_evicted_beside_a_holder_when_that_alone_makes_room():
    # GPU 1: PX (holds gA there) 30 GB, A 40 GB, 10 GB free. PY needs 40 GB: evicting A is enough (a
    # first hold's spare, 51 GB in all, moves what may be moved: it never makes PY wait on the holder).
    jobs = {"PX": JobState(workers=worker_on("PX", 1)), "A": JobState(workers=worker_on("A", 2)),
            "PY": JobState(workers=worker_on("PY", 3))}
    ns = NodeState(agent=agent4([80 * GB, 10 * GB], {"PX": {"gpu1": 30 * GB}, "A": {"gpu1": 40 * GB}}))
    held = {"PX": [R.GroupSpec([{"node": "n1", "gpus": [1]}])]}
    g = group_gpus([("PY", 9, 40 * GB)], [1])
    assert P.plan_group(g, {"n1": ns}, jobs, 0, holding=lambda j: held.get(j, [])) == [
        P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 0)]
    # 60 GB is more than A's 40 GB and the 10 GB free: nothing is parked, PY waits for PX.
    g = group_gpus([("PY", 9, 60 * GB)], [1])
    assert P.plan_group(g, {"n1": ns}, jobs, 0, holding=lambda j: held.get(j, [])) == []
    # A gone (parked elsewhere): 50 GB free beside the holder. PY's 40 GB fits, its spare does not:
    # granted, not kept waiting on PX.
    ns.agent = agent4([80 * GB, 50 * GB], {"PX": {"gpu1": 30 * GB}})
    jobs.pop("A")
    [grant] = P.plan_group(group_gpus([("PY", 9, 40 * GB)], [1]), {"n1": ns}, jobs, 0,
                           holding=lambda j: held.get(j, []))
    assert isinstance(grant, P.WriteGrant) and grant.job == "PY", grant


def test_a_released_grant_wakes_the_blocked_groups_on_its_nodes():
    from timeslice.common.server.etcd.watch import DELETE, PUT, WatchEvent
    from timeslice.common.server.keys import Keys
    from timeslice.lockd.index import StateIndex
    from timeslice.lockd.scheduler import Scheduler

    keys = Keys("/t/")
    idx = StateIndex(keys)

    def ev(kind, key, value=b""):
        return WatchEvent(kind, rpc.KeyValue(key=key, value=value, create_revision=1, mod_revision=1), None)

    touched = idx.apply([ev(PUT, keys.spec(g), R.GroupSpec([{"node": n, "gpus": [i]}]).dump())
                         for g, n, i in (("gA", "n1", 0), ("gB", "n1", 1), ("gC", "n2", 0))])
    touched |= idx.apply([ev(PUT, keys.grant("gA"), R.GrantValue("PX", 5, 1).dump())])
    assert not any(kind == "released" for kind, _ in touched)
    touched = idx.apply([ev(DELETE, keys.grant("gA"))])
    assert ("released", "gA") in touched

    sched = Scheduler(None, keys, idx, None, P.Policy(), None)
    marked = []
    sched._mark = marked.append
    sched._blocked = {"gB", "gC"}
    sched.on_touched({("released", "gA")})
    assert marked == ["gB"]          # gB shares n1 with gA and waits; gC is on another node


def test_a_snapshot_intent_says_how_much_room_is_needed():
    """B needs its 30 GB snapshot and the footprint's margin (lockd.footprints), 5 GB are free: A is
    asked to free the difference, so a cooperative A releases only that much (discard regions
    first). Unknown need: everything."""
    jobs = workers("A", "B")
    ns = NodeState(agent=agent(free=5 * GB), statuses={"B": status("B", R.SNAPSHOTTED, device_bytes=30 * GB)})
    [a] = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0)
    admitted = FP.admitted(FP.footprint([0], seen={0: 30 * GB}, capacity={0: 80 * GB}), 0)
    assert 30 * GB < admitted < 31 * GB
    assert (a.job, a.op, a.need_bytes) == ("A", R.SNAPSHOT, admitted - 5 * GB)
    [a] = P.plan_group(group([("B", 9, 0)]), {"n1": NodeState(agent=agent(free=70 * GB))}, workers("A"), 0)
    assert a.need_bytes == 0


def test_no_grant_past_a_job_that_lost_its_session_while_on_the_gpus():
    """H held the group and its lease expired (its registrations went with it), but the agent still
    reports it running: B, though it fits beside H, waits until the agent has frozen H (then H leaves
    the agent's running jobs) or seen it exit."""
    stale = {"n1": NodeState(agent=agent(free=60 * GB, jobs={"H": 10 * GB}))}
    assert P.plan_group(group([("B", 9, 10 * GB)]), stale, {}, 0) == []
    fenced = {"n1": NodeState(agent=agent(free=60 * GB, jobs={}))}
    [g] = P.plan_group(group([("B", 9, 10 * GB)]), fenced, {}, 0)
    assert isinstance(g, P.WriteGrant) and g.job == "B"
    # A job that is still registered is a resident, not an unfenced one: elided as before.
    [g] = P.plan_group(group([("B", 9, 10 * GB)]), stale, workers("H"), 0)
    assert isinstance(g, P.WriteGrant) and g.elided


# --- the swap path never loses track of a job ------------------------------------------------------

def agent_seen(free, job_bytes=None, job_gpus=None, unknown=(), total=32 * GB):
    """One GPU (uuid gpu0) as the agent reports it: per-job bytes and GPUs, and the jobs it cannot read."""
    return kv("agent", R.AgentValue("n1", "sim", gpus=[{"index": 0, "uuid": "gpu0", "total_bytes": total,
                                                        "free_bytes": free}],
                                    device_total_bytes=total, device_free_bytes=free,
                                    job_device_bytes=job_bytes or {}, job_gpus=job_gpus or {},
                                    job_unknown=list(unknown)))


def test_a_partially_paused_job_is_a_resident_and_is_asked_for_the_rest():
    """The partial-pause livelock: C's selective pause released its 7 GB discard region and kept 13 GB
    (context + offload) on the 32 GB GPU; A needs its 20 GB snapshot back and 19 GB are free. C must be
    asked to free the rest; today A's restore is written, refused for room, and retried until the timeout."""
    jobs = workers("A", "C", "E")
    ns = NodeState(agent=agent_seen(19 * GB, job_bytes={"C": 13 * GB}, job_gpus={"C": {"gpu0": 13 * GB}}),
                   statuses={"A": snap("A", {"gpu0": 20 * GB}), "C": snap("C", {"gpu0": 7 * GB}),
                             "E": snap("E", {"gpu0": 18 * GB})})
    [a] = P.plan_group(group([("A", 9, 0)]), {"n1": ns}, jobs, 0)
    admitted = FP.admitted(FP.footprint([0], seen={0: 20 * GB}, capacity={0: 32 * GB}), 0)   # snapshot + margin
    assert (a.job, a.op, a.token, a.need_bytes) == ("C", R.SNAPSHOT, 9, admitted - 19 * GB), a
    # C is fully paused now (nothing of it listed on the device): A's restore comes.
    ns.intents["C"] = intent("C", R.SNAPSHOT, 9, mod=30)
    ns.statuses["C"] = kv("st/C", R.StatusValue(R.SNAPSHOTTED, "C", outcome=R.OK, intent_revision=30, token=9,
                                                bytes=12 * GB, device_bytes=19 * GB, gpu_bytes={"gpu0": 19 * GB}))
    ns.agent = agent_seen(31 * GB)
    assert P.plan_group(group([("A", 9, 0)]), {"n1": ns}, jobs, 0) == [P.WriteIntent("n1", "A", R.RESTORE, 9, 0)]


def test_a_partially_paused_head_is_restored_like_any_snapshot():
    ns = NodeState(agent=agent_seen(19 * GB, job_bytes={"C": 13 * GB}, job_gpus={"C": {"gpu0": 13 * GB}}),
                   statuses={"C": snap("C", {"gpu0": 7 * GB})})
    assert P.plan_group(group([("C", 9, 0)]), {"n1": ns}, workers("C"), 0) == [
        P.WriteIntent("n1", "C", R.RESTORE, 9, 0)]


def test_a_parked_job_whose_session_went_with_memory_left_is_a_resident_not_an_unfenced_one():
    """C's registrations went while a partial pause kept 13 GB of it on the GPU: it runs nothing
    (parked), so nobody waits for it to be frozen; its regions are asked to go like any resident's."""
    ns = NodeState(agent=agent_seen(19 * GB, job_bytes={"C": 13 * GB}, job_gpus={"C": {"gpu0": 13 * GB}}),
                   statuses={"A": snap("A", {"gpu0": 20 * GB}), "C": snap("C", {"gpu0": 7 * GB})})
    [a] = P.plan_group(group([("A", 9, 0)]), {"n1": ns}, workers("A"), 0)
    assert (a.job, a.op) == ("C", R.SNAPSHOT), a


def test_an_unknown_head_is_never_granted_before_a_restore_says_its_memory_is_back():
    """The agent restarted and C's cooperative worker has not reconnected: C's last status says
    running, the agent says it cannot tell. C gets a restore intent (the agent answers it once the
    worker is back), and the grant only after its answer; today C is granted at once."""
    ns = NodeState(agent=agent_seen(12 * GB, unknown=["C"]), statuses={"C": status("C", R.RUNNING, R.OK)})
    assert P.plan_group(group([("C", 9, 0)]), {"n1": ns}, workers("C"), 0) == [
        P.WriteIntent("n1", "C", R.RESTORE, 9, 0)]
    ns.intents["C"] = intent("C", R.RESTORE, 9, mod=30)
    assert P.plan_group(group([("C", 9, 0)]), {"n1": ns}, workers("C"), 0) == []          # waits
    # A failed op of an unreachable worker leaves the status "unknown": the same.
    st = {"C": status("C", R.UNKNOWN, R.FAILED, error="did not come back")}
    assert P.plan_group(group([("C", 9, 0)]), {"n1": NodeState(agent=agent_seen(12 * GB), statuses=st)},
                        workers("C"), 0) == [P.WriteIntent("n1", "C", R.RESTORE, 9, 0)]
    # Answered ok: granted, even if the worker's channel dropped again since (its memory is back).
    ns.statuses["C"] = kv("st/C", R.StatusValue(R.RUNNING, "C", op=R.RESTORE, outcome=R.OK, intent_revision=30,
                                                token=9))
    [g] = P.plan_group(group([("C", 9, 0)]), {"n1": ns}, workers("C"), 0)
    assert isinstance(g, P.WriteGrant) and g.restored


def test_an_unknown_resident_counts_as_resident_with_its_registered_footprint():
    """A job the agent cannot read is resident: with what the meter sees of it, or (unplaced) its
    registration on every GPU; a status "unknown" (a failed op of an unreachable worker) likewise.
    Today a status "unknown" reads as gone, and B is granted beside C's 20 GB."""
    jobs = {"B": JobState(session=kv("s", b"{}"), workers=worker_on("B", 1)),
            "C": JobState(session=kv("s", b"{}"), workers=worker_on("C", 2, nbytes=20 * GB))}
    for ns in (NodeState(agent=agent_seen(12 * GB, unknown=["C"])),
               NodeState(agent=agent_seen(12 * GB, job_bytes={"C": 20 * GB}, job_gpus={"C": {"gpu0": 20 * GB}},
                                          unknown=["C"])),
               NodeState(agent=agent_seen(12 * GB), statuses={"C": status("C", R.UNKNOWN, R.FAILED)})):
        [a] = P.plan_group(group([("B", 9, 16 * GB)]), {"n1": ns}, jobs, 0)
        assert (a.job, a.op) == ("C", R.SNAPSHOT), (ns, a)


def test_a_parked_jobs_residue_in_the_way_is_checkpointed_not_ignored():
    """C's cooperative pause released its regions and left 2 GB (context, allocator blocks) on the
    32 GB GPU; B needs 31 GB and 30 GB are free, nobody is resident. C's residue goes by full
    isolation's checkpoint, for this swap only, written over C's answered pause of the same swap.
    Before, B was granted without room (or its restore was refused until the swap timeout)."""
    jobs = workers("B", "C")
    paused = kv("st/C", R.StatusValue(R.SNAPSHOTTED, "C", outcome=R.OK, intent_revision=30, token=9,
                                      bytes=10 * GB, device_bytes=20 * GB, gpu_bytes={"gpu0": 20 * GB},
                                      residue_bytes=2 * GB), mod=31)
    ns = NodeState(agent=agent_seen(30 * GB), statuses={"C": paused},
                   intents={"C": intent("C", R.SNAPSHOT, 9, mod=30)})
    [a] = P.plan_group(group([("B", 9, 31 * GB)]), {"n1": ns}, jobs, 0)
    assert a == P.WriteIntent("n1", "C", R.SNAPSHOT, 9, 30, isolation=R.ISOLATION_FULL), a
    # Issued: B waits for its answer, and the intent is not written again.
    ns.intents["C"] = kv("in/C", R.IntentValue(R.SNAPSHOT, "C", "g", 9, 7, 1000, isolation=R.ISOLATION_FULL),
                         create=30, mod=32)
    assert P.plan_group(group([("B", 9, 31 * GB)]), {"n1": ns}, jobs, 0) == []
    # Answered: the residue is off the device (0 left), B fits and is granted.
    ns.statuses["C"] = kv("st/C", R.StatusValue(R.SNAPSHOTTED, "C", outcome=R.OK, intent_revision=32, token=9,
                                                bytes=2 * GB, device_bytes=22 * GB, gpu_bytes={"gpu0": 22 * GB}))
    ns.agent = agent_seen(32 * GB)
    [g] = P.plan_group(group([("B", 9, 31 * GB)]), {"n1": ns}, jobs, 0)
    assert isinstance(g, P.WriteGrant) and g.job == "B"
    # Where it fits anyway, or the residue belongs to a collective worker, nothing extra is asked.
    ns.statuses["C"], ns.agent, ns.intents["C"] = paused, agent_seen(30 * GB), intent("C", R.SNAPSHOT, 9, mod=30)
    [g] = P.plan_group(group([("B", 9, 20 * GB)]), {"n1": ns}, jobs, 0)
    assert isinstance(g, P.WriteGrant)
    collective = {**jobs, "C": JobState(session=kv("s", b"{}"), workers={("n1", 1001): kv(
        "w", R.WorkerValue(1001, "n1", swap=swaps.COOPERATIVE, collective=True))})}
    assert not any(isinstance(a, P.WriteIntent) and a.job == "C"
                   for a in P.plan_group(group([("B", 9, 31 * GB)]), {"n1": ns}, collective, 0))


def test_a_head_to_restore_that_is_short_sends_the_residue_first_and_its_restore_beside_it():
    """B is parked itself (29 GB snapshot); its footprint is its snapshot and the margin, less
    nothing of its own left on the device. 28 GB are free beside C's 2 GB residue: C's residue goes
    first, and B's restore waits (its snapshot alone does not fit). With 30 GB free the snapshot
    fits but not the footprint: B's restore goes beside C's residue checkpoint, the grant waits for
    both. Where lockd's figures say it fits and the agent (fresher figures) refuses, the residue goes
    after the refusal, then the restore is asked again."""
    from timeslice.nodeagent.hostmem import DEFAULT_DEVICE_HEADROOM_BYTES
    assert P.RESTORE_HEADROOM_BYTES == DEFAULT_DEVICE_HEADROOM_BYTES       # lockd's copy of the agent's
    jobs = workers("B", "C")
    paused = kv("st/C", R.StatusValue(R.SNAPSHOTTED, "C", outcome=R.OK, intent_revision=30, token=5,
                                      bytes=10 * GB, device_bytes=20 * GB, gpu_bytes={"gpu0": 20 * GB},
                                      residue_bytes=2 * GB), mod=31)
    ns = NodeState(agent=agent_seen(28 * GB), statuses={"C": paused, "B": snap("B", {"gpu0": 29 * GB})})
    full_c = P.WriteIntent("n1", "C", R.SNAPSHOT, 9, 0, isolation=R.ISOLATION_FULL)
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0) == [full_c]
    ns.agent = agent_seen(29 * GB + GB // 2)
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0) == [full_c, P.WriteIntent("n1", "B", R.RESTORE, 9, 0)]
    # A smaller B fits by lockd's figures: its restore goes to the agent, nothing else.
    ns.statuses["B"] = snap("B", {"gpu0": 20 * GB})
    assert P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0) == [P.WriteIntent("n1", "B", R.RESTORE, 9, 0)]
    ns.intents["B"] = intent("B", R.RESTORE, 9, mod=40)
    ns.statuses["B"] = kv("st/B", R.StatusValue(R.SNAPSHOTTED, "B", outcome=R.REFUSED, intent_revision=40, token=9,
                                                device_bytes=20 * GB, gpu_bytes={"gpu0": 20 * GB},
                                                error="no room"), mod=41)
    [a] = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0)
    assert a == full_c, a


def test_a_selective_pause_that_left_too_little_is_asked_for_the_rest_not_waited_on_forever():
    """Found on the H200 (two 7B jobs): A's selective pause of this swap (asked for 30 GB) was done,
    but A still held 17 GB beside the head, which needed a little more than was then free. The
    planner wanted another snapshot of A, saw this swap's snapshot intent of A already written, and
    waited for its report, which was in: no intent, no grant, until a job's timeout killed it."""
    jobs = workers("A", "B")
    need = intent_need("A", 9, mod=30, need=30 * GB)
    ns = NodeState(agent=agent_seen(14 * GB, job_bytes={"A": 17 * GB, "B": 2 * GB},
                                    job_gpus={"A": {"gpu0": 17 * GB}, "B": {"gpu0": 2 * GB}}, total=64 * GB),
                   intents={"A": need},
                   statuses={"A": kv("st/A", R.StatusValue(R.SNAPSHOTTED, "A", op=R.SNAPSHOT, outcome=R.OK,
                                                           intent_revision=30, token=9, bytes=30 * GB,
                                                           device_bytes=30 * GB, gpu_bytes={"gpu0": 30 * GB})),
                             "B": snap("B", {"gpu0": 30 * GB})})
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0)
    assert acts == [P.WriteIntent("n1", "A", R.SNAPSHOT, 9, 30, need_bytes=0)], acts
    assert acts[0].need_bytes == 0                                  # the rest of A this time
    # That one done too, and A still in the way (what it keeps outside its regions): the head's
    # restore goes to the agent, which admits on exact figures (refusals retried, then failed
    # with the reason): never a wait with nothing written.
    ns.intents["A"] = kv("in/A", R.IntentValue(R.SNAPSHOT, "A", "g", 9, 7, 1000), create=30, mod=40)
    ns.statuses["A"] = kv("st/A", R.StatusValue(R.SNAPSHOTTED, "A", op=R.SNAPSHOT, outcome=R.OK, intent_revision=40,
                                                token=9, bytes=15 * GB, device_bytes=45 * GB,
                                                gpu_bytes={"gpu0": 45 * GB}))
    ns.agent = agent_seen(28 * GB, job_bytes={"A": 2 * GB, "B": 2 * GB},
                          job_gpus={"A": {"gpu0": 2 * GB}, "B": {"gpu0": 2 * GB}}, total=64 * GB)
    acts = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, jobs, 0)
    assert acts and all(isinstance(a, P.WriteIntent) for a in acts), acts
    assert P.WriteIntent("n1", "B", R.RESTORE, 9, 0) in acts or any(a.job == "A" and a.isolation for a in acts)


def intent_need(job, token, mod, need):
    return kv(f"in/{job}", R.IntentValue(R.SNAPSHOT, job, "g", token, 7, 1000, need_bytes=need), create=mod, mod=mod)


def test_a_head_still_short_after_all_was_taken_from_the_others_fails_with_the_reason_in_time():
    """Nothing more to take (A's regions and its residue are gone, the meter still shows it in the way)
    and a head with nothing to restore: it waits within the swap timeout, then fails saying why."""
    jobs = workers("A", "B")
    done = kv("in/A", R.IntentValue(R.SNAPSHOT, "A", "g", 9, 7, 1000, isolation=R.ISOLATION_FULL), create=30, mod=40)
    ns = NodeState(agent=agent_seen(10 * GB, job_bytes={"A": 3 * GB}, job_gpus={"A": {"gpu0": 3 * GB}}),
                   intents={"A": done},
                   statuses={"A": kv("st/A", R.StatusValue(R.SNAPSHOTTED, "A", op=R.SNAPSHOT, outcome=R.OK,
                                                           intent_revision=40, token=9, device_bytes=20 * GB,
                                                           gpu_bytes={"gpu0": 20 * GB}))})
    g = group([("B", 9, 20 * GB)])
    assert P.plan_group(g, {"n1": ns}, jobs, 0) == []
    [f] = P.plan_group(g, {"n1": ns}, jobs, 10 ** 9)
    assert isinstance(f, P.FailWaiter) and f.job == "B" and "no room" in f.reason, f


# --- a grant is a promise the GPU is usable: the footprint rule (lockd/footprints.py) --------------

def queued(job, tok, hint, peak=0, context=0):
    """A group whose queue holds ``job`` with the figures its Acquire sent."""
    gs = group([])
    gs.queue[job] = kv(f"q/{job}", R.QueueValue(job, 100 + tok, hint, peak_bytes=peak, context_bytes=context),
                       create=tok, lease=100 + tok)
    return gs


def parked_with_residue(job="C", residue=2 * GB, collective=False):
    """C parked cooperatively (its pause of an earlier swap answered), 2 GB left on the 32 GB GPU."""
    st = kv(f"st/{job}", R.StatusValue(R.SNAPSHOTTED, job, op=R.SNAPSHOT, outcome=R.OK, intent_revision=30, token=5,
                                       bytes=10 * GB, device_bytes=20 * GB, gpu_bytes={"gpu0": 20 * GB},
                                       residue_bytes=residue), mod=31)
    w = R.WorkerValue(1001, "n1", swap=swaps.COOPERATIVE, collective=collective)
    return st, JobState(session=kv("s", b"{}"), workers={("n1", 1001): kv("w", w)})


def test_first_hold_is_granted_only_with_room_to_spare_else_the_parked_residue_goes_first():
    """B declares 24 GB and has no observed peak (its first hold): admitted with its context, the
    margin and a first hold's spare, 31 GB, more than the 30 GB free beside C's 2 GB residue. C's
    residue goes first. Before, B was granted on its declaration with 6 GB to spare by that figure."""
    st, cjs = parked_with_residue()
    jobs = {**workers("B"), "C": cjs}
    ns = NodeState(agent=agent_seen(30 * GB), statuses={"C": st}, intents={"C": intent("C", R.SNAPSHOT, 5, mod=30)})
    [a] = P.plan_group(queued("B", 9, 24 * GB), {"n1": ns}, jobs, 0)
    assert (a.job, a.op, a.isolation) == ("C", R.SNAPSHOT, R.ISOLATION_FULL), a
    # The same job with an observed peak of 24 GB (a later hold): no spare, it fits; nothing moves.
    [g] = P.plan_group(queued("B", 9, 24 * GB, peak=24 * GB, context=GB // 2), {"n1": ns}, jobs, 0)
    assert isinstance(g, P.WriteGrant) and g.job == "B", g
    # A collective job's residue is never taken (a driver restore of its context loses it): granted as before.
    st, cjs = parked_with_residue(collective=True)
    [g] = P.plan_group(queued("B", 9, 24 * GB), {"n1": ns}, {**workers("B"), "C": cjs}, 0)
    assert isinstance(g, P.WriteGrant), g


def test_a_phase_that_grew_past_its_declaration_is_granted_on_the_observed_peak():
    """B declared 20 GB; its second phase peaked at 29 GB (reported with its next Acquire). Its next
    grant is planned on the 29 GB: C's residue must leave first. On the declaration alone it fit."""
    st, cjs = parked_with_residue()
    jobs = {**workers("B"), "C": cjs}
    ns = NodeState(agent=agent_seen(30 * GB), statuses={"C": st}, intents={"C": intent("C", R.SNAPSHOT, 5, mod=30)})
    [g] = P.plan_group(queued("B", 9, 20 * GB), {"n1": ns}, jobs, 0)
    assert isinstance(g, P.WriteGrant), g
    [a] = P.plan_group(queued("B", 9, 20 * GB, peak=29 * GB, context=GB // 2), {"n1": ns}, jobs, 0)
    assert (a.job, a.op, a.isolation) == ("C", R.SNAPSHOT, R.ISOLATION_FULL), a


def test_a_head_whose_own_snapshot_of_an_earlier_swap_is_running_waits_for_its_answer():
    """The fit long fault run: A was being parked for C's swap (token 5) when C was killed; A, the head
    now (token 9), must not be granted while the agent is still checkpointing it: only that op's answer
    says where A's memory is (parked: restore it first)."""
    snap = intent("A", R.SNAPSHOT, 5, mod=30, issued_ms=1000)
    ns = NodeState(agent=agent(free=70 * GB), intents={"A": snap},
                   statuses={"A": status("A", R.RUNNING, R.OK, intent_rev=20, token=3)})
    pol = P.Policy(swap_timeout_ms=5000)
    assert P.plan_group(group([("A", 9, 0)]), {"n1": ns}, workers("A"), 2000, pol) == []
    ns.statuses["A"] = status("A", R.SNAPSHOTTED, R.OK, intent_rev=30, token=5, device_bytes=10 * GB)
    assert P.plan_group(group([("A", 9, 0)]), {"n1": ns}, workers("A"), 2500, pol) == [
        P.WriteIntent("n1", "A", R.RESTORE, 9, 30)]
    # An earlier swap's op that nobody answered within the swap timeout does not hold the head forever.
    ns.statuses["A"] = status("A", R.RUNNING, R.OK, intent_rev=20, token=3)
    acts = P.plan_group(group([("A", 9, 0)]), {"n1": ns}, workers("A"), 7000, pol)
    assert acts and not any(isinstance(a, P.FailWaiter) for a in acts)
