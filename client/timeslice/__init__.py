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
    CancelledError,
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
from timeslice.model import Grant, Group, GroupStatus, JobInfo, NodeSpec, Released, Worker
from timeslice.retry import RetryPolicy

__all__ = [
    "OrchestratorClient", "TimeSliceOrchestratorClient", "AsyncOrchestratorClient",
    "Grant", "Released", "Group", "GroupStatus", "JobInfo", "NodeSpec", "Worker", "RetryPolicy",
    "release_framework_cache",
    "TimesliceClientError", "SessionLostError", "SessionConflictError", "AuthError", "NotHolderError",
    "StaleTokenError", "PreconditionError", "GroupBusyError", "UnknownGroupError", "AlreadyExistsError",
    "InvalidArgumentError", "DeadlineError", "AcquireTimeoutError", "SwapFailedError", "UnavailableError",
    "CancelledError", "ClientClosedError", "InternalError",
]
