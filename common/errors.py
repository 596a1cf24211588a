"""The exception tree shared by lockd, nodeagent and the etcd layer.

One root, ``TimesliceError``; every module raises a subclass with a stable
``code`` so that the gRPC servicers can map it to a status in one place.
"""
from __future__ import annotations


class TimesliceError(Exception):
    """Root of every error this project raises on purpose."""

    code = "INTERNAL"


class ConfigError(TimesliceError):
    """A setting is invalid; raised at start-up, before anything runs."""

    code = "INVALID_ARGUMENT"


class InvalidIdError(TimesliceError):
    """An id does not follow the documented grammar (see timeslice.common.ids)."""

    code = "INVALID_ARGUMENT"


class EtcdError(TimesliceError):
    """etcd could not be reached or answered with an error."""

    code = "UNAVAILABLE"


class EtcdUnavailable(EtcdError):
    """No etcd member answered within the deadline."""


class OutcomeUnknown(EtcdError):
    """A write may or may not have been applied (deadline exceeded in flight).

    Callers resolve it by reading, never by blindly re-applying.
    """


class WatchCompacted(EtcdError):
    """The revision a watch wanted has been compacted away."""

    code = "INTERNAL"

    def __init__(self, compact_revision: int):
        super().__init__(f"revision compacted below {compact_revision}")
        self.compact_revision = compact_revision


class SessionError(TimesliceError):
    """Something is wrong with an etcd session (lease)."""

    code = "FAILED_PRECONDITION"


class SessionLost(SessionError):
    """The session's lease expired or was revoked: everything it owned is gone."""

    code = "ABORTED"


class SessionClosed(SessionError):
    """The session was closed by its owner."""


class LockError(TimesliceError):
    """A FIFO queue / lock operation failed."""

    code = "FAILED_PRECONDITION"


class GuardFailed(LockError):
    """A transaction's outer guard did not hold: what it guarded (e.g. the group's spec) changed
    since the caller looked. Nothing was written; the caller looks again."""


class NotHolder(LockError):
    """The caller does not hold the lock (or holds it with another token)."""


class StaleToken(LockError):
    """A fencing token older than the current one was presented."""


class ElectionError(TimesliceError):
    """Leader election failed."""

    code = "UNAVAILABLE"


class NotLeader(ElectionError):
    """A leader-guarded write failed: this replica is no longer the leader."""

    code = "UNAVAILABLE"


class EtcdLeaseGone(EtcdError):
    """A write named a lease etcd no longer has: the session was closed or expired meanwhile.

    Not transient (retrying the same write fails the same way): the caller's
    session is gone, so ABORTED, the code a client answers by checking its session.
    """

    code = "ABORTED"


class EtcdRequestTooLarge(EtcdError):
    """etcd refused a request over its size limit: the input was too big, retrying cannot help."""

    code = "INVALID_ARGUMENT"


class EtcdNoSpace(EtcdError):
    """etcd's database is full (NOSPACE alarm): an operator must compact and defragment."""

    code = "RESOURCE_EXHAUSTED"


class EtcdRefused(EtcdError):
    """etcd refused this server's own credentials or request (a deployment or program error)."""

    code = "INTERNAL"
