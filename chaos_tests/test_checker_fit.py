"""The checker's fit rules (fitrules.py) in hand-made histories: each planted violation is caught,
its clean twin passes, and a fit group is not judged by the mutex of an exclusive one."""
from __future__ import annotations

from chaos_tests.checker import check

MS = 1_000_000
GB = 1 << 30
FIT = {"g": {"capacity": {"n1/0": 80 * GB}, "margin": 0}}


def ev(t_ms: float, kind: str, job: str, group: str = "g", **fields) -> dict:
    return {"ev": kind, "t": int(t_ms * MS), "job": job, "group": group, **fields}


def turn(req: float, grant: float, end: float, job: str, token: int, gb: int | None = None,
         backfilled: bool = False) -> list[dict]:
    """A job asks at ``req``, is granted ``token`` weighing ``gb`` on n1/0 (None: the whole device)."""
    facts = {"exclusive": True} if gb is None else {"footprint": {"n1/0": gb * GB}}
    return [ev(req, "acquire_req", job), ev(req + 0.1, "enqueued", job, token=token),
            ev(grant, "granted", job, token=token, backfilled=backfilled, **facts),
            ev(grant + 0.1, "fence_ok", job, token=token), ev(grant + 0.2, "cs_start", job, token=token),
            ev(end, "fence_ok", job, token=token), ev(end + 0.1, "cs_end", job, token=token),
            ev(end + 0.2, "yield", job, token=token)]


def side_by_side() -> list[dict]:
    # A (30) and B (40) overlap: 70 <= 80. C (30) waits until A leaves (B + C = 70).
    return turn(0, 1, 10, "A", 10, 30) + turn(2, 3, 20, "B", 12, 40) + turn(4, 11, 30, "C", 14, 30)


def test_holders_side_by_side_within_capacity_pass_and_are_no_mutex_violation():
    report = check(side_by_side(), fit=FIT)
    assert report.ok, report.violations
    assert check(side_by_side()).of_kind("mutex")            # judged as an exclusive group, it is one


def test_sections_over_capacity_are_a_fit_violation():
    events = turn(0, 1, 10, "A", 10, 30) + turn(2, 3, 20, "B", 12, 40) + turn(4, 5, 30, "C", 14, 30)
    bad = check(events, fit=FIT).of_kind("fit")
    assert bad and "n1/0" in bad[0]
    assert check(events, fit={"g": {"capacity": {"n1/0": 100 * GB}, "margin": 0}}).ok
    assert check(events, fit={"g": {"capacity": {"n1/0": 100 * GB}, "margin": 1}}).of_kind("fit")


def test_an_exclusive_holder_beside_another_is_a_fit_violation():
    events = turn(0, 1, 10, "A", 10, None) + turn(2, 3, 20, "B", 12, 1)
    assert check(events, fit=FIT).of_kind("fit")
    events = turn(0, 1, 10, "A", 10, 1) + turn(2, 3, 20, "B", 12, None)
    assert check(events, fit=FIT).of_kind("fit")
    assert check(turn(0, 1, 10, "A", 10, None) + turn(2, 11, 20, "B", 12, 1), fit=FIT).ok


def test_a_job_whose_tokens_go_back_is_a_token_job_violation():
    events = turn(0, 1, 2, "A", 10, 10) + turn(3, 4, 5, "A", 9, 10)
    assert check(events, fit=FIT).of_kind("token-job")
    assert check(turn(0, 1, 2, "A", 10, 10) + turn(3, 4, 5, "A", 11, 10), fit=FIT).ok


def test_overtaking_without_a_backfill_is_a_fifo_violation_and_a_backfill_is_not():
    # B queued before C asked; C (token 14, re-keyed B gets 16) granted first.
    events = turn(0, 1, 30, "A", 10, 40) + turn(2, 31, 40, "B", 16, 50) + turn(3, 4, 20, "C", 14, 10)
    assert check(events, fit=FIT).of_kind("fifo-fit")
    events = turn(0, 1, 30, "A", 10, 40) + turn(2, 31, 40, "B", 16, 50) + turn(3, 4, 20, "C", 14, 10, True)
    report = check(events, fit=FIT)
    assert report.ok, report.violations
    assert check(events, fit={"g": {**FIT["g"], "max_backfills": 0}}).of_kind("starve")


def test_a_section_counts_while_its_grant_exists():
    # A's lease lapsed at 5 (the observer saw its grant go); A, paused, runs on to 10; B enters at 6.
    events = turn(0, 1, 10, "A", 10, 60) + turn(2, 6, 20, "B", 12, 60)
    assert check(events, fit=FIT).of_kind("fit")
    events.append(ev(5, "grant_end", "A", token=10))
    assert check(events, fit=FIT).ok


def test_a_grant_end_the_observer_told_late_is_ordered_by_etcds_revisions():
    """CI's fit run with a holder paused past its TTL: etcd deleted A's grant (revision 40) before it
    wrote B's (41), but the observer's thread, lagging on a loaded machine, delivered the delete
    after B's client had entered. By delivery time they overlapped; by etcd's order they did not."""
    events = turn(0, 1, 10, "A", 10, 60) + turn(2, 6, 20, "B", 12, 60)
    events += [ev(5.9, "grant_put", "B", token=12, rev=41), ev(7, "grant_end", "A", token=10, rev=40)]
    report = check(events, fit=FIT)
    assert report.ok, report.violations
    # B's grant written while A's still stood (the delete after it): over capacity, a violation.
    events[-1] = ev(7, "grant_end", "A", token=10, rev=42)
    assert check(events, fit=FIT).of_kind("fit")
