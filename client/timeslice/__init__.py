"""timeslice: co-operative GPU time-slicing for RL jobs, on an etcd-backed FIFO lock.

    from timeslice import OrchestratorClient
    orchestrator = OrchestratorClient(target="lockd:50051", job_id="job-1")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train(batch): ...

See client.py (sync), aio.py (async), errors.py (exceptions), retry.py (failover rules).
"""
from timeslice.aio import AsyncOrchestratorClient
from timeslice.client import OrchestratorClient, TimeSliceOrchestratorClient
from timeslice.errors import (
    AcquireTimeoutError,
    AlreadyExistsError,
    AuthError,
    CallCancelledError,
    ClientClosedError,
    DeadlineError,
    GroupBusyError,
    InternalError,
    InvalidArgumentError,
    NotHolderError,
    PreconditionError,
    SessionConflictError,
    SessionLostError,
    StaleTokenError,
    SwapFailedError,
    TimesliceClientError,
    UnavailableError,
    UnknownGroupError,
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
from timeslice.common.version import __version__

__all__ = [
    "__version__",
    "AcquireTimeoutError",
    "AlreadyExistsError",
    "AsyncOrchestratorClient",
    "AuthError",
    "CallCancelledError",
    "ClientClosedError",
    "DeadlineError",
    "Grant",
    "Group",
    "GroupBusyError",
    "GroupStatus",
    "InternalError",
    "InvalidArgumentError",
    "JobInfo",
    "NodeSpec",
    "NotHolderError",
    "OrchestratorClient",
    "PreconditionError",
    "Released",
    "RetryPolicy",
    "SessionConflictError",
    "SessionLostError",
    "StaleTokenError",
    "SwapFailedError",
    "TimeSliceOrchestratorClient",
    "TimesliceClientError",
    "UnavailableError",
    "UnknownGroupError",
    "Worker",
    "release_framework_cache",
]
