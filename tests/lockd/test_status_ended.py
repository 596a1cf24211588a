"""``timeslice status`` never shows a job with no live session as running. Sans-IO (the status picture
from the leader's index): the agent's last status for a job outlives it until the cleanup pass."""
from __future__ import annotations

from tests.lockd.test_plan import kv
from timeslice.common.server import records as R
from timeslice.common.server.keys import Keys
from timeslice.lockd.groups import ENDED, Groups
from timeslice.lockd.index import StateIndex

K = Keys("/t/")


def picture(sessions: tuple[str, ...]) -> dict[str, str]:
    kvs = {K.spec("g"): kv("spec", R.GroupSpec([{"node": "n1", "gpus": []}])),
           K.agent("n1"): kv("agent", R.AgentValue("n1", "sim")),
           K.status("n1", "a"): kv("st/a", R.StatusValue(R.RUNNING, "a", outcome=R.OK)),
           K.status("n1", "b"): kv("st/b", R.StatusValue(R.SNAPSHOTTED, "b", outcome=R.OK))}
    for job in sessions:
        kvs[K.session(job)] = kv(f"s/{job}", b"{}")
    for key, value in list(kvs.items()):
        kvs[key] = value.__class__(key=key, value=value.value, create_revision=1, mod_revision=1)
    index = StateIndex(K)
    index.rebuild(kvs)
    st = Groups(None, K, index).status("g", 1, 1)
    return {j.job_id: j.state for n in st.node_status for j in n.jobs}


def test_a_job_whose_session_is_gone_is_ended_not_running():
    assert picture(("a", "b")) == {"a": R.RUNNING, "b": R.SNAPSHOTTED}
    assert picture(("b",)) == {"a": ENDED, "b": R.SNAPSHOTTED}
    assert picture(()) == {"a": ENDED, "b": ENDED}
