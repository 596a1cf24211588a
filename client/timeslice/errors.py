"""The client's exception tree, and the one table that maps a gRPC status to it.

Every error the client raises on purpose is a ``TimesliceClientError`` (itself a
``timeslice.common.errors.TimesliceError``), so ``except TimesliceClientError`` catches
them all. Each carries the gRPC ``code`` name it came from (or ``None`` for
errors made on the client side), the server's ``reason`` prefix when there is
one (``not_holder``, ``stale_token``, ``not_queued``), and a message that ends
with what to do about it.

The mapping lives in ``_TABLE`` below, in one place: ``(code, reason)`` first,
then ``(code, None)``. Only the status *code* and the reason prefix are used to
choose a class; the rest of the server's message is kept verbatim.
"""
from __future__ import annotations

from timeslice.common import rpcs
from timeslice.common.channel import ChannelError
from timeslice.common.errors import TimesliceError


class TimesliceClientError(TimesliceError):
    """Root of every error the timeslice client raises."""

    #: the gRPC status name of the reply that caused it; None for an error raised locally
    code: str | None = None  # type: ignore[assignment]  # the servers' errors always carry one
    #: What a caller should do about it; appended to the message.
    hint = ""

    def __init__(self, message: str = "", *, code: str | None = None, reason: str | None = None,
                 details: str = "", method: str | None = None):
        self.details = details or message
        self.reason = reason
        self.method = method
        if code is not None:
            self.code = code
        text = message or details or type(self).__name__
        if self.hint and self.hint not in text:
            text = f"{text} — {self.hint}"
        super().__init__(text)


class SessionLostError(TimesliceClientError):
    """The job's session lease is gone: every hold and worker record went with it."""

    code = "ABORTED"
    hint = ("the job no longer holds any group; stop using the GPUs, then call "
            "client.reset_session() (or make a new client) to start a fresh session")


class SessionConflictError(TimesliceClientError):
    """Another live session already owns this job id."""

    code = "ALREADY_EXISTS"
    hint = ("another process is using this job id; give each job its own id "
            "(TIMESLICE_JOB_ID), or wait for the old session's TTL to pass")


class AuthError(TimesliceClientError):
    """The session secret does not open the job's session (it was replaced)."""

    code = "UNAUTHENTICATED"
    hint = ("the job's session now belongs to another process with the same job id; "
            "this client's session is lost")


class CredentialsError(TimesliceClientError):
    """A call that needs a credential (the admin token, a tenant's token) came without one lockd knows.

    Not a session loss: the job's session, if it has one, is untouched."""

    code = "UNAUTHENTICATED"
    hint = ("give the client the right token: TIMESLICE_ADMIN_TOKEN or TIMESLICE_ADMIN_TOKEN_FILE for admin "
            "calls (`timeslice up` writes one into its run folder), TIMESLICE_TENANT_TOKEN or "
            "TIMESLICE_TENANT_TOKEN_FILE for a tenant's; nothing was changed")


class PermissionDeniedError(TimesliceClientError):
    """The caller may not do this: another job's process, a system process, another tenant's group,
    or admin calls switched off on that server."""

    code = "PERMISSION_DENIED"
    hint = ("nothing was changed, and retrying will not change the answer: act only on what is this "
            "job's (or this tenant's), or ask the operator for access")


class NotHolderError(TimesliceClientError):
    """Yield by a job that does not hold the group (waiting, already yielded, or never acquired)."""

    code = "FAILED_PRECONDITION"
    hint = "only yield a group after acquire() returned it, and only once"


class StaleTokenError(TimesliceClientError):
    """A fencing token older than the job's current one was presented."""

    code = "FAILED_PRECONDITION"
    hint = "use the token of the latest acquire() of this group"


class PreconditionError(TimesliceClientError):
    """The request is valid but the state forbids it now (e.g. a group with jobs queued)."""

    code = "FAILED_PRECONDITION"
    hint = "check the group with `timeslice status GROUP` and retry when the state allows it"


class WrongDeviceError(PreconditionError, ChannelError):
    """This process's SIMULATED device memory is not on the device its node agent watches
    (raised when the worker joins the agent's channel; the message names both folders)."""

    hint = ""


class GroupBusyError(PreconditionError):
    """delete_group on a group that still has jobs queued."""

    hint = "wait until the group is idle, or pass force=True (--force) to delete it anyway"


class UnknownGroupError(TimesliceClientError):
    """The group does not exist (or was deleted while the job waited)."""

    code = "NOT_FOUND"
    hint = "check the name with `timeslice groups`"


class AlreadyExistsError(TimesliceClientError):
    """The object exists already, with other settings."""

    code = "ALREADY_EXISTS"
    hint = "delete it first, or use the settings it already has"


class InvalidArgumentError(TimesliceClientError):
    """An id outside the grammar, a missing field or a bad value."""

    code = "INVALID_ARGUMENT"
    hint = "fix the value and retry; nothing was changed"


class DeadlineError(TimesliceClientError):
    """A call did not finish within its deadline (after failover and retries)."""

    code = "DEADLINE_EXCEEDED"
    hint = "lockd is slow or unreachable; check `timeslice groups` and the lockd replicas, then retry"


class AcquireTimeoutError(DeadlineError):
    """acquire() was not granted within its timeout; the job's place in the queue was given up."""

    hint = "the group stayed busy; retry later, or pass a longer timeout (None waits forever)"


class ResourceExhaustedError(TimesliceClientError):
    """Something ran out: etcd's space, a message size; the message says what."""

    code = "RESOURCE_EXHAUSTED"
    hint = "read what ran out above; nothing was changed"


class LimitExceededError(ResourceExhaustedError):
    """One of lockd's limits is reached (sessions, watches, workers, groups); the message names it."""

    hint = ("close what this caller no longer uses (sessions, WatchGroup streams, workers, groups), "
            "or ask the operator to raise the limit the message names; nothing was changed")


class SwapFailedError(ResourceExhaustedError):
    """The scheduler could not swap this job in (agent refused, failed or dead); the waiter was removed."""

    hint = "read the reason above; check `timeslice status GROUP` for the node agents, then acquire again"


class UnavailableError(TimesliceClientError):
    """No lockd replica could serve the call within the failover deadline."""

    code = "UNAVAILABLE"
    hint = ("check that lockd runs and can reach etcd, and that TIMESLICE_TARGET (or target=) "
            "lists its address(es)")


class CallCancelledError(TimesliceClientError):
    """The call was cancelled before it finished."""

    code = "CANCELLED"


class GroupRevokedError(TimesliceClientError):
    """An admin deleted a group while this job held it: the hold ended then (see lockd/revocations.py).

    Not a session loss: the job's session and its other holds live on."""

    code = "ABORTED"
    hint = ("whatever ran on the group's devices after the deletion ran without the lock; "
            "stop that phase, then acquire the group again once it exists")

    def __init__(self, message: str = "", *, grant=None, group_id: str | None = None, **kw):
        super().__init__(message, **kw)
        self.grant = grant
        self.group_id = group_id or (grant.group_id if grant is not None else None)


class ClientClosedError(TimesliceClientError):
    """The client was used after close()."""

    hint = "make a new client"


class ClientForkedError(ClientClosedError):
    """The client was made in a parent process and used in a child after fork()."""

    hint = ("a client's session, channels and event loop belong to the process that made it; "
            "make a new client in the child")


class UnimplementedError(TimesliceClientError):
    """The server does not serve this call: it is another version than this client (or not lockd)."""

    code = "UNIMPLEMENTED"
    hint = "check that the target is lockd, and that lockd and the client are of the same release"


class InternalError(TimesliceClientError):
    """lockd failed in an unexpected way (a bug, or a status this client does not know)."""

    code = "INTERNAL"
    hint = ("lockd's log has the details (the message names an incident); whether the call took effect "
            "is not known: check before doing it again")


# ---------------------------------------------------------------------------
# The one mapping from gRPC status (and reason prefix) to exception.
# (code, reason) is looked up first, then (code, None); Acquire's deadline is
# the only per-method case (it means "not granted in time", not "lockd slow").
# ---------------------------------------------------------------------------
_TABLE: dict[tuple[str, str | None], type[TimesliceClientError]] = {
    ("FAILED_PRECONDITION", "not_holder"): NotHolderError,
    ("FAILED_PRECONDITION", "not_queued"): NotHolderError,
    ("FAILED_PRECONDITION", "stale_token"): StaleTokenError,
    ("FAILED_PRECONDITION", None): PreconditionError,
    ("ABORTED", "group_deleted"): GroupRevokedError,
    ("ABORTED", None): SessionLostError,
    ("UNAUTHENTICATED", None): AuthError,
    ("NOT_FOUND", None): UnknownGroupError,
    ("INVALID_ARGUMENT", None): InvalidArgumentError,
    ("OUT_OF_RANGE", None): InvalidArgumentError,
    ("ALREADY_EXISTS", None): AlreadyExistsError,
    ("DEADLINE_EXCEEDED", None): DeadlineError,
    ("RESOURCE_EXHAUSTED", "limit"): LimitExceededError,
    ("RESOURCE_EXHAUSTED", None): ResourceExhaustedError,
    ("PERMISSION_DENIED", None): PermissionDeniedError,
    ("UNIMPLEMENTED", None): UnimplementedError,
    ("UNAVAILABLE", None): UnavailableError,
    ("CANCELLED", None): CallCancelledError,
}
_PER_METHOD: dict[tuple[str, str], type[TimesliceClientError]] = {
    ("Acquire", "DEADLINE_EXCEEDED"): AcquireTimeoutError,
    ("Acquire", "RESOURCE_EXHAUSTED"): SwapFailedError,       # (a limit's says "limit max_...": reason first)
    ("OpenSession", "ALREADY_EXISTS"): SessionConflictError,
    ("DeleteGroup", "FAILED_PRECONDITION"): GroupBusyError,
}


def reason_of(details: str) -> str | None:
    """The reason code a message starts with (``not_holder: ...`` → ``not_holder``), if any.
    lockd's limits say ``limit max_<name>: ...``: their reason is ``limit``."""
    if (details or "").startswith("limit max_"):
        return "limit"
    head, sep, _ = (details or "").partition(":")
    if sep and head and head.replace("_", "").isalpha() and head.islower():
        return head
    return None


def error_class(code: str, details: str = "", method: str | None = None) -> type[TimesliceClientError]:
    reason = reason_of(details)
    if (code, reason) in _TABLE and reason is not None:
        return _TABLE[(code, reason)]
    if code == "UNAUTHENTICATED" and method is not None and method not in rpcs.SESSION:
        return CredentialsError                  # a missing or unknown token; on a session call: AuthError
    if method is not None and (method, code) in _PER_METHOD:
        return _PER_METHOD[(method, code)]
    return _TABLE.get((code, None), InternalError)


def from_status(code: str, details: str = "", method: str | None = None,
                note: str = "") -> TimesliceClientError:
    """The exception for a gRPC status ``code`` name (e.g. ``"NOT_FOUND"``) and its message."""
    cls = error_class(code, details, method)
    where = f"{method}: " if method else ""
    msg = f"{where}{details or code}{note}"
    return cls(msg, code=code, reason=reason_of(details), details=details, method=method)
