"""Which processes the agent freezes and thaws (sans-IO: nodeagent.orphans)."""
from timeslice.nodeagent import orphans as O


def states(**by_pid):
    return lambda pid: by_pid.get(f"p{pid}", O.GONE)


def test_a_job_whose_registrations_vanish_while_on_a_gpu_is_frozen_then_thawed_when_back():
    o = O.Orphans()
    assert o.step({1: "H", 2: "H"}, states(p1=O.ON_DEVICE, p2=O.OFF_DEVICE)).freeze == {}
    step = o.step({}, states(p1=O.ON_DEVICE, p2=O.OFF_DEVICE))
    assert step.freeze == {1: "H"}                     # p2 held no device context: nothing to stop
    o.record(step.freeze, {})
    assert o.frozen_jobs() == ["H"]
    assert o.step({1: "X"}, states(p1=O.OFF_DEVICE)).thaw == {}        # another job's word thaws nothing
    step = o.step({1: "H"}, states(p1=O.OFF_DEVICE))
    assert step.thaw == {1: "H"}
    o.record({}, step.thaw)
    assert o.frozen_jobs() == []


def test_exited_processes_are_forgotten():
    o = O.Orphans()
    o.step({1: "H"}, states(p1=O.ON_DEVICE))
    o.record(o.step({}, states(p1=O.ON_DEVICE)).freeze, {})
    assert o.step({}, states()).forgotten == [1] and o.frozen_jobs() == []
    assert o.step({}, states()).freeze == {}           # a gone process is never frozen


def test_a_deliberate_let_go_freezes_nothing():
    o = O.Orphans()
    o.step({1: "H"}, states(p1=O.ON_DEVICE))
    assert o.step({}, states(p1=O.ON_DEVICE), deliberate=lambda job: job == "H").freeze == {}
