"""Housekeeping of departed jobs' intents and statuses, sans-IO."""
from tests.lockd.test_plan import intent, kv, status
from timeslice.common.server import records as R
from timeslice.lockd.cleanup import Forget, plan_cleanup
from timeslice.lockd.index import GroupState, JobState, NodeState


def test_only_departed_jobs_answered_intents_and_empty_statuses_go():
    ns = NodeState(
        intents={"gone": intent("gone", R.SNAPSHOT, 9, mod=20),
                 "pending": intent("pending", R.RESTORE, 9, mod=30),
                 "live": intent("live", R.SNAPSHOT, 9, mod=40)},
        statuses={"gone": status("gone", R.SNAPSHOTTED, R.OK, intent_rev=20),
                  "pending": status("pending", R.SNAPSHOTTED, R.OK, intent_rev=25),
                  "live": status("live", R.RUNNING, R.OK, intent_rev=40),
                  "done": status("done", R.RUNNING, R.OK, intent_rev=11),
                  "parked": status("parked", R.SNAPSHOTTED, R.OK, intent_rev=12),
                  "queued": status("queued", R.GONE, R.PROCESS_GONE, intent_rev=13)})
    jobs = {"live": JobState(session=kv("s", b"{}"))}
    groups = {"g": GroupState(queue={"queued": kv("q/queued", R.QueueValue("queued"), create=50)})}
    out = plan_cleanup(groups, {"n1": ns}, jobs)
    keys = {f.key for f in out}
    # the departed job's answered intent goes (its snapshotted status stays: a parked context)
    assert b"in/gone" in keys and b"st/gone" not in keys
    assert b"in/pending" not in keys                  # not answered yet
    assert b"in/live" not in keys and b"st/live" not in keys
    assert b"st/done" in keys                         # departed, nothing held
    assert b"st/parked" not in keys                   # departed but its context is in host memory
    assert b"st/queued" not in keys                   # still queued somewhere
    assert all(isinstance(f, Forget) and f.mod_revision > 0 for f in out)
