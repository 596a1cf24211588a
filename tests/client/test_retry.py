"""The retry decision (retry.py) without a server: which statuses re-send, and what
an error on a re-send means."""
from __future__ import annotations

import pytest
import tenacity

from timeslice.retry import (
    Action,
    Call,
    CallState,
    RetryPolicy,
    StopPolicy,
    attempt_timeout,
    remaining,
)

IDEMPOTENT = [Call.ACQUIRE, Call.YIELD, Call.KEEPALIVE, Call.CLOSE_SESSION, Call.REGISTER_WORKER,
              Call.UNREGISTER_WORKER, Call.CREATE_GROUP, Call.DELETE_GROUP, Call.LIST_GROUPS,
              Call.GROUP_STATUS, Call.WATCH_GROUP, Call.LIST_JOBS, Call.OPEN_SESSION]


@pytest.mark.parametrize("call", IDEMPOTENT)
def test_unavailable_fails_over_and_resends(call):
    d = CallState(call).decide("UNAVAILABLE", "failed to connect to all addresses")
    assert d.action is Action.RETRY and d.failover


@pytest.mark.parametrize("details", ["Stream removed", "Socket closed", "connection reset by peer"])
def test_transport_failures_reported_as_unknown_are_unavailable(details):
    d = CallState(Call.ACQUIRE).decide("UNKNOWN", details)
    assert d.action is Action.RETRY and d.failover


def test_unknown_application_error_is_not_retried():
    assert CallState(Call.YIELD).decide("UNKNOWN", "Unexpected <class 'KeyError'>").action is Action.RAISE


def test_attempt_deadline_of_a_short_call_fails_over():
    d = CallState(Call.KEEPALIVE).decide("DEADLINE_EXCEEDED", "Deadline Exceeded")
    assert d.action is Action.RETRY and d.failover


def test_acquire_deadline_is_the_callers_timeout_not_a_retry():
    assert CallState(Call.ACQUIRE).decide("DEADLINE_EXCEEDED", "was not granted").action is Action.RAISE


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED",
                                  "FAILED_PRECONDITION", "ALREADY_EXISTS"])
def test_definite_errors_are_raised(code):
    assert CallState(Call.ACQUIRE if code != "ALREADY_EXISTS" else Call.CREATE_GROUP).decide(code, "x").action \
        is Action.RAISE


def test_not_queued_on_first_yield_is_an_error():
    st = CallState(Call.YIELD)
    assert st.decide("FAILED_PRECONDITION", "not_queued: 'j' does not hold 'g'").action is Action.RAISE


@pytest.mark.parametrize("first", ["UNAVAILABLE", "DEADLINE_EXCEEDED"])
def test_not_queued_after_a_maybe_applied_yield_is_success(first):
    st = CallState(Call.YIELD)
    assert st.decide(first, "").action is Action.RETRY
    assert st.maybe_applied
    assert st.decide("FAILED_PRECONDITION", "not_queued: 'j' does not hold 'g'").action is Action.SUCCEED


def test_other_yield_preconditions_stay_errors_after_a_retry():
    st = CallState(Call.YIELD)
    st.decide("UNAVAILABLE", "")
    assert st.decide("FAILED_PRECONDITION", "stale_token: token 3 is not ...").action is Action.RAISE
    assert st.decide("FAILED_PRECONDITION", "not_holder: 'j' is waiting").action is Action.RAISE


def test_delete_group_not_found_after_maybe_applied_attempt_is_success():
    st = CallState(Call.DELETE_GROUP)
    assert st.decide("NOT_FOUND", "unknown group").action is Action.RAISE
    st = CallState(Call.DELETE_GROUP)
    st.decide("UNAVAILABLE", "")
    assert st.decide("NOT_FOUND", "unknown group").action is Action.SUCCEED


def test_open_session_waits_out_an_older_session():
    d = CallState(Call.OPEN_SESSION).decide("ALREADY_EXISTS", "job 'j' already has a live session")
    assert d.action is Action.RETRY and not d.failover


def test_acquire_aborted_is_verified_a_bounded_number_of_times():
    st = CallState(Call.ACQUIRE, max_verifications=2)
    assert st.decide("ABORTED", "lost its place").action is Action.VERIFY_SESSION
    assert st.decide("ABORTED", "lost its place").action is Action.VERIFY_SESSION
    assert st.decide("ABORTED", "lost its place").action is Action.RAISE


def test_keepalive_aborted_is_a_lost_session():
    assert CallState(Call.KEEPALIVE).decide("ABORTED", "expired").action is Action.RAISE


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_stop_policy_window_counts_from_the_first_failure():
    clock = Clock()
    stop = StopPolicy(deadline=None, window=5.0, clock=clock)
    clock.t = 1000.0                      # a long successful wait before the first failure
    assert not stop(None)
    clock.t = 1004.9
    assert not stop(None)
    clock.t = 1005.0
    assert stop(None)


def test_stop_policy_deadline():
    clock = Clock()
    stop = StopPolicy(deadline=101.0, window=60.0, clock=clock)
    assert not stop(None)
    clock.t = 101.0
    assert stop(None)


def test_attempt_timeout_is_capped_by_what_is_left():
    clock = Clock()
    assert attempt_timeout(None, 5.0, clock) == 5.0
    assert attempt_timeout(None, None, clock) is None
    assert attempt_timeout(102.0, 5.0, clock) == 2.0
    assert attempt_timeout(110.0, 5.0, clock) == 5.0
    assert remaining(99.0, clock) == 0.0


def test_policy_validation_and_tenacity_pieces():
    with pytest.raises(ValueError):
        RetryPolicy(initial_backoff=3, max_backoff=1)
    p = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, failover_window=1)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise tenacity.TryAgain
        return "ok"

    r = tenacity.Retrying(wait=p.wait(), stop=p.stop(None), reraise=True)
    assert r(flaky) == "ok" and len(calls) == 3
