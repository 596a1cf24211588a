"""Every intent the planner writes says why (lockd's ``intent`` log line carries it): which job needs
how many bytes where, and what is free there. Sans-IO."""
from __future__ import annotations

import inspect
import re

from tests.lockd import test_plan, test_plan_strict
from tests.lockd.test_plan import GB, agent, group, status, workers
from timeslice.common.server import records as R
from timeslice.lockd import plan as P
from timeslice.lockd.index import NodeState

SCENARIOS = [f for m in (test_plan, test_plan_strict) for name, f in sorted(vars(m).items())
             if name.startswith("test_") and inspect.isfunction(f) and not inspect.signature(f).parameters]


def test_every_intent_of_every_planner_scenario_carries_its_reason(monkeypatch):
    seen: list[P.WriteIntent] = []
    real = P.plan_group

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.extend(a for a in out if isinstance(a, P.WriteIntent))
        return out
    monkeypatch.setattr(P, "plan_group", spy)
    for scenario in SCENARIOS:
        scenario()
    assert len(seen) > 30 and {i.op for i in seen} >= {R.SNAPSHOT, R.RESTORE, R.FREEZE, R.THAW}
    assert [i for i in seen if not i.reason] == []


def test_an_eviction_says_who_needs_what_where_and_what_is_free():
    ns = NodeState(agent=agent(free=5 * GB), statuses={"B": status("B", R.SNAPSHOTTED, device_bytes=30 * GB)})
    [a] = P.plan_group(group([("B", 9, 0)]), {"n1": ns}, workers("A", "B"), 0)
    assert (a.job, a.op) == ("A", R.SNAPSHOT)
    # its admitted footprint (the 30 GB snapshot, with lockd.footprints' margin) against what is free
    need = float(re.search(r"needs (\d+\.\d+) GiB", a.reason).group(1))
    assert "job B on n1" in a.reason and 30.0 <= need < 32.0 and "5.00 GiB free" in a.reason
    assert "job A is resident there" in a.reason


def test_an_unknown_footprint_says_so():
    """Hint 0 and never measured is unknown: room is made (an emptied device), and the log says why."""
    nodes = {"n1": NodeState(agent=agent(free=70 * GB))}
    [a] = P.plan_group(group([("B", 9, 0)]), nodes, workers("A"), 0)
    assert "job B's footprint is unknown" in a.reason and "device_bytes_hint" in a.reason
    # with a hint, it fits beside A: nothing is written at all
    assert P.plan_group(group([("B", 9, 10 * GB)]), nodes, workers("A"), 0) == [
        P.WriteGrant("B", 9, 109, restored=False, elided=True, bytes_moved=0)]
