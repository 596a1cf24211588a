"""When to re-send a call, and what an error on a re-send means. Sans-IO.

The client's transport (transport.py, ``Transport.invoke``) drives it: it sends
an attempt and hands a failed status to ``ClientCore.react`` (core.py), which
asks ``CallState.decide`` and does what the ``Decision`` says. Nothing here performs
I/O, sleeps or reads the clock except through the injectable ``clock``, so
every branch is unit-tested without a server (tests/client/test_retry.py).

Rules, per RPC (``Call``):

* Only calls that are idempotent *by design* are re-sent: Acquire (a re-sent
  Acquire finds the job's existing queue entry, and a holder gets its grant
  back), Yield (it carries the token), KeepAlive, CloseSession, worker
  (un)registration (a put / delete of one key), CreateGroup (create-if-absent,
  same nodes), DeleteGroup, and every read.
* ``UNAVAILABLE`` (the replica is gone or cannot reach etcd) → move to the next
  target and re-send. A ``DEADLINE_EXCEEDED`` of one *attempt* of a short call
  (a paused replica) does the same; for Acquire a deadline is the caller's
  timeout and ends the call.
* An attempt that failed with ``UNAVAILABLE`` or ``DEADLINE_EXCEEDED`` *may have
  been applied*. After one, the errors that prove it was are success:
  Yield's ``not_queued:`` (the earlier attempt released the group) and
  DeleteGroup's ``NOT_FOUND`` (the earlier attempt deleted it).
* OpenSession is not idempotent: an attempt whose reply was lost leaves a
  session nobody keeps alive. Its ``ALREADY_EXISTS`` is therefore waited out
  (re-sent with backoff until the orphan lease expires) within the open deadline.
* Acquire's ``ABORTED`` ("lost its place") is checked before it is believed:
  a replica that saw an earlier attempt cancelled may have removed the entry
  while the session is fine. The driver verifies the session (a KeepAlive) and
  re-sends; only a failed verification is a lost session.

Backoff is tenacity's exponential backoff with full jitter; a call stops when
its overall deadline passes or when replicas have failed without a break for
``failover_window`` seconds, whichever comes first.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tenacity

#: Status codes after which an attempt may have been applied by the server.
MAYBE_APPLIED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
#: Transport failures reported as UNKNOWN/INTERNAL by some gRPC versions when a peer dies.
_TRANSPORT_HINTS = ("stream removed", "socket closed", "connection reset", "rst_stream",
                    "broken pipe", "connection refused", "goaway")


class Call(enum.Enum):
    OPEN_SESSION = "OpenSession"
    CLOSE_SESSION = "CloseSession"
    KEEPALIVE = "KeepAlive"
    ACQUIRE = "Acquire"
    YIELD = "Yield"
    REGISTER_WORKER = "RegisterWorker"
    UNREGISTER_WORKER = "UnregisterWorker"
    CREATE_GROUP = "CreateGroup"
    DELETE_GROUP = "DeleteGroup"
    LIST_GROUPS = "ListGroups"
    GROUP_STATUS = "GetGroupStatus"
    WATCH_GROUP = "WatchGroup"
    LIST_JOBS = "ListJobs"
    GET_PROFILES = "GetProfiles"

    @property
    def method(self) -> str:
        return self.value


class Action(enum.Enum):
    RETRY = "retry"                    # re-send (after backoff)
    SUCCEED = "succeed"                # the error proves an earlier attempt was applied
    VERIFY_SESSION = "verify_session"  # check the session, then re-send (Acquire's ABORTED)
    RAISE = "raise"                    # map the status to an exception and raise it


@dataclass(frozen=True)
class Decision:
    action: Action
    #: Move to the next target before the re-send (the current one failed us).
    failover: bool = False
    why: str = ""


@dataclass
class CallState:
    """Per-call memory of the retry logic: what happened on earlier attempts."""

    call: Call
    #: The caller gave Acquire a deadline (finite timeout).
    acquire_deadline: bool = False
    attempts: int = 0
    maybe_applied: bool = False
    verifications: int = 0
    max_verifications: int = 3
    last_code: str = ""
    last_details: str = ""

    def decide(self, code: str, details: str = "") -> Decision:
        """What to do after an attempt failed with status ``code`` (a name, e.g. ``"UNAVAILABLE"``)."""
        self.attempts += 1
        prior_maybe_applied = self.maybe_applied
        self.last_code, self.last_details = code, details
        d = _decide(self, code, details or "", prior_maybe_applied)
        if code in MAYBE_APPLIED or _is_transport(code, details):
            self.maybe_applied = True
        if d.action is Action.VERIFY_SESSION:
            self.verifications += 1
        return d


def _is_transport(code: str, details: str) -> bool:
    return code in ("UNKNOWN", "INTERNAL") and any(h in (details or "").lower() for h in _TRANSPORT_HINTS)


def _decide(st: CallState, code: str, details: str, prior_maybe_applied: bool) -> Decision:
    call = st.call
    reason = details.partition(":")[0] if ":" in details else ""
    if code == "UNAVAILABLE" or _is_transport(code, details):
        return Decision(Action.RETRY, failover=True, why="replica unavailable")
    if code == "DEADLINE_EXCEEDED":
        if call is Call.ACQUIRE:
            return Decision(Action.RAISE, why="acquire timeout")
        return Decision(Action.RETRY, failover=True, why="attempt deadline (replica slow or paused)")
    if call is Call.YIELD and prior_maybe_applied and code == "FAILED_PRECONDITION" and reason == "not_queued":
        return Decision(Action.SUCCEED, why="an earlier attempt released the group")
    if call is Call.DELETE_GROUP and prior_maybe_applied and code == "NOT_FOUND":
        return Decision(Action.SUCCEED, why="an earlier attempt deleted the group")
    if call is Call.OPEN_SESSION and code == "ALREADY_EXISTS":
        return Decision(Action.RETRY, why="an older session of this job id is still alive; waiting for it")
    if call is Call.ACQUIRE and code == "ABORTED" and st.verifications < st.max_verifications:
        return Decision(Action.VERIFY_SESSION, why="queue entry gone; checking the session before believing it")
    return Decision(Action.RAISE)


# ---------------------------------------------------------------------------
# Timing: tenacity pieces the drivers plug into Retrying / AsyncRetrying.
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """Backoff and deadlines of re-sends; defaults documented beside each field."""

    initial_backoff: float = 0.05   # s; first wait is uniform in [0, initial*2]
    max_backoff: float = 2.0        # s; cap of one wait
    failover_window: float = 30.0   # s; give up after replicas failed this long without a break
    attempt_timeout: float = 5.0    # s; deadline of one attempt of a short (non-blocking) call

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError("retry policy needs 0 < initial_backoff <= max_backoff")
        if self.failover_window <= 0 or self.attempt_timeout <= 0:
            raise ValueError("failover_window and attempt_timeout must be > 0")

    def wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_random_exponential(multiplier=self.initial_backoff, max=self.max_backoff)

    def stop(self, deadline: float | None, clock: Callable[[], float] = time.monotonic) -> StopPolicy:
        return StopPolicy(deadline, self.failover_window, clock)


@dataclass
class StopPolicy(tenacity.stop.stop_base):
    """Stop re-sending when the call's deadline is reached or failures last ``window`` seconds.

    The window counts from the first failure this stop object sees, not from the
    start of the call: an Acquire that waited an hour and then lost its replica
    still gets the whole window to find another one.
    """

    deadline: float | None
    window: float
    clock: Callable[[], float] = time.monotonic
    first_failure: float | None = field(default=None)

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        now = self.clock()
        if self.first_failure is None:
            self.first_failure = now
        if self.deadline is not None and now >= self.deadline:
            return True
        return now - self.first_failure >= self.window


class TryAgain(Exception):
    """Raised inside a tenacity attempt to ask for a re-send; carries the last status."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


def retry_on_try_again() -> tenacity.retry_base:
    return tenacity.retry_if_exception_type(TryAgain)


def remaining(deadline: float | None, clock: Callable[[], float] = time.monotonic) -> float | None:
    """Seconds left until ``deadline`` (monotonic), never negative; ``None`` = no deadline."""
    return None if deadline is None else max(0.0, deadline - clock())


def attempt_timeout(deadline: float | None, cap: float | None,
                    clock: Callable[[], float] = time.monotonic) -> float | None:
    """The deadline of one attempt: the time left, capped by ``cap`` (``None`` = uncapped)."""
    left = remaining(deadline, clock)
    if left is None:
        return cap
    return left if cap is None else min(left, cap)
