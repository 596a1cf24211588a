"""The checker's priority rules (priorityrules.py) in hand-made histories: FIFO within a class,
the overtaking bound, and that a priority group is not judged by request-order tokens."""
from __future__ import annotations

from chaos_tests.checker import check

MS = 1_000_000


def ev(t_ms: float, kind: str, job: str, group: str = "g", **fields) -> dict:
    return {"ev": kind, "t": int(t_ms * MS), "job": job, "group": group, **fields}


def turn(req: float, grant: float, job: str, token: int, cls: int = 0, group: str = "g") -> list[dict]:
    return [ev(req, "acquire_req", job, group, priority=cls), ev(req + 0.1, "enqueued", job, group, token=token),
            ev(grant, "granted", job, group, token=token), ev(grant + 0.2, "cs_start", job, group, token=token),
            ev(grant + 0.5, "cs_end", job, group, token=token), ev(grant + 0.6, "yield", job, group, token=token)]


def served_by_class() -> list[dict]:
    # A holds; L (class 0) joins, then H1, H2 (class 5); H1 and H2 overtake L, L re-keyed (token 40).
    return (turn(0, 1, "A", 10) + turn(2, 10, "H1", 30, 5) + turn(1.5, 20, "L", 40, 0)
            + turn(3, 15, "H2", 35, 5))


def test_priority_group_served_by_class_within_its_bound_passes():
    events = served_by_class()
    report = check(events, priorities={"g": 2})
    assert report.ok, report.violations
    # The same history judged as a FIFO group: L asked before H1 and H2, so the order is a violation.
    assert check(events).of_kind("fifo")


def test_overtaking_past_the_bound_is_caught():
    report = check(served_by_class(), priorities={"g": 1})
    assert report.of_kind("overtake") and "L" in report.of_kind("overtake")[0]


def test_fifo_within_a_class_is_caught():
    # H2 asked after H1 joined, both class 5, yet H2 was granted first.
    events = turn(0, 1, "A", 10) + turn(2, 15, "H1", 40, 5) + turn(3, 10, "H2", 35, 5)
    report = check(events, priorities={"g": 4})
    assert report.of_kind("fifo-class") and "H2" in report.of_kind("fifo-class")[0]
    # Different classes: no fifo-class violation.
    events = turn(0, 1, "A", 10) + turn(2, 15, "L", 40, 0) + turn(3, 10, "H", 35, 5)
    assert check(events, priorities={"g": 4}).ok


def test_tokens_must_still_increase_in_grant_order():
    # The overtaken L granted under its old (smaller) key: the fence would refuse it.
    events = turn(0, 1, "A", 10) + turn(1.5, 20, "L", 20, 0) + turn(2, 10, "H", 30, 5)
    assert check(events, priorities={"g": 4}).of_kind("token-order")
