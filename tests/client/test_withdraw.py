"""When a failed acquire() is taken back, and what each answer to the withdrawal means (withdraw.py)."""
from timeslice import withdraw as W


def test_which_failures_may_have_left_the_entry():
    assert W.needs_withdraw("UNAVAILABLE", "connection refused")
    assert W.needs_withdraw("DEADLINE_EXCEEDED", "Deadline Exceeded")          # the client's own deadline
    assert W.needs_withdraw("CANCELLED", "")
    # lockd's own timeout gave the place up; the others prove the entry is gone or never was.
    assert not W.needs_withdraw("DEADLINE_EXCEEDED", "'j' was not granted 'g' within 1.000s; its place in the "
                                "queue was given up")
    for code in ("ABORTED", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAUTHENTICATED", None):
        assert not W.needs_withdraw(code, "")


def test_verdicts():
    assert W.verdict(None) is W.Verdict.GRANTED
    assert W.verdict("DEADLINE_EXCEEDED", "... its place in the queue was given up") is W.Verdict.DONE
    assert W.verdict("DEADLINE_EXCEEDED", "Deadline Exceeded") is W.Verdict.RETRY   # no answer: maybe stalled
    assert W.verdict("UNAVAILABLE") is W.Verdict.RETRY
    for code in ("ABORTED", "UNAUTHENTICATED", "NOT_FOUND", "CANCELLED", "RESOURCE_EXHAUSTED"):
        assert W.verdict(code) is W.Verdict.DONE
