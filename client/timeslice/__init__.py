"""timeslice: co-operative GPU time-slicing for RL jobs, on an etcd-backed FIFO lock.

    from timeslice import OrchestratorClient
    orchestrator = OrchestratorClient(target="lockd:50051", job_id="job-1")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train(batch): ...

See aio.py (the client), client.py (its sync face), errors.py (exceptions), retry.py (failover rules).
"""
# First: its exit handler must be registered before any client's, so that it runs after them (see the module).
from timeslice import teardown  # noqa: F401
from timeslice.aio import AsyncOrchestratorClient
from timeslice.client import OrchestratorClient, TimeSliceOrchestratorClient
from timeslice.common.version import __version__
from timeslice.errors import (
    AcquireTimeoutError,
    AlreadyExistsError,
    AuthError,
    CallCancelledError,
    ClientClosedError,
    ClientForkedError,
    CredentialsError,
    DeadlineError,
    GroupBusyError,
    GroupRevokedError,
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    NotHolderError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    SessionConflictError,
    SessionLostError,
    StaleTokenError,
    SwapFailedError,
    TimesliceClientError,
    UnavailableError,
    UnimplementedError,
    UnknownGroupError,
    WrongDeviceError,
)
from timeslice.hooks import release_framework_cache
from timeslice.model import (
    Grant,
    Group,
    GroupStatus,
    JobInfo,
    NodeSpec,
    Released,
    Worker,
)
from timeslice.retry import RetryPolicy

__all__ = [
    "AcquireTimeoutError",
    "AlreadyExistsError",
    "AsyncOrchestratorClient",
    "AuthError",
    "CallCancelledError",
    "ClientClosedError",
    "ClientForkedError",
    "CredentialsError",
    "DeadlineError",
    "Grant",
    "Group",
    "GroupBusyError",
    "GroupRevokedError",
    "GroupStatus",
    "InternalError",
    "InvalidArgumentError",
    "JobInfo",
    "LimitExceededError",
    "NodeSpec",
    "NotHolderError",
    "OrchestratorClient",
    "PermissionDeniedError",
    "PreconditionError",
    "Released",
    "ResourceExhaustedError",
    "RetryPolicy",
    "SessionConflictError",
    "SessionLostError",
    "StaleTokenError",
    "SwapFailedError",
    "TimeSliceOrchestratorClient",
    "TimesliceClientError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownGroupError",
    "Worker",
    "WrongDeviceError",
    "__version__",
    "release_framework_cache",
]
