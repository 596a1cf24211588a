"""lockd's own errors; each carries the gRPC status name it maps to (see servicer.py)."""
from tscore.errors import LockError, TimesliceError


class NotFound(TimesliceError):
    code = "NOT_FOUND"


class AlreadyExists(TimesliceError):
    code = "ALREADY_EXISTS"


class BadSecret(TimesliceError):
    code = "UNAUTHENTICATED"


class SwapFailed(LockError):
    """The swap for this job's grant could not be done; the waiter was removed."""

    code = "RESOURCE_EXHAUSTED"


class GroupBusy(LockError):
    code = "FAILED_PRECONDITION"


class AcquireTimeout(LockError):
    code = "DEADLINE_EXCEEDED"


class Superseded(LockError):
    """A re-sent Acquire of the same job took over this call's queue entry."""

    code = "CANCELLED"
