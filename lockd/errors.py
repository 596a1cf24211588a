"""lockd's own errors; each carries the gRPC status name it maps to (``rpc``, common/server/serving.py, maps it)."""
from timeslice.common.errors import LockError, TimesliceError


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


class GroupRevoked(LockError):
    """An admin deleted the group while this job held (or waited for) it."""

    code = "ABORTED"


class LimitExceeded(TimesliceError):
    """A count limit (groups, workers of a job, ...) is reached; the message names the limit."""

    code = "RESOURCE_EXHAUSTED"


class NotOwner(TimesliceError):
    """The caller asked to act on something that belongs to another job."""

    code = "PERMISSION_DENIED"


class SystemProcess(NotOwner):
    """The pid is one of the node's own servers (init, the agent, etcd, lockd): no job may register it."""


class Unauthenticated(TimesliceError):
    """A call that needs a credential came without one (or with one this server does not know)."""

    code = "UNAUTHENTICATED"


class Forbidden(TimesliceError):
    """The caller's tenant may not do this with that group (tenancy: lockd/tenancy.py)."""

    code = "PERMISSION_DENIED"
