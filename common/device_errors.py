"""The node agent's backend error tree, rooted in ``timeslice.common.errors.TimesliceError``.

Every failure of a checkpoint backend is one of these, so the agent loop can
decide what to do from the *type* (retry later, report refusal, report the job
lost) and report the message verbatim. Each class keeps the pid and, when the
failure came from the CUDA driver (directly or through ``cuda-checkpoint``),
the numeric ``CUresult`` and its name, because those are what an operator
searches for.

``code`` follows the gRPC status names, as in ``timeslice.common.errors``.
"""
from __future__ import annotations

from timeslice.common.errors import TimesliceError


class BackendError(TimesliceError):
    """A checkpoint backend operation failed."""

    code = "INTERNAL"

    def __init__(self, message: str, *, pid: int | None = None,
                 cu_result: int | None = None, cu_name: str | None = None):
        super().__init__(message)
        self.pid = pid
        self.cu_result = cu_result
        self.cu_name = cu_name


class BackendUnavailable(BackendError):
    """This backend cannot run on this machine (no libcuda, old driver, no binary)."""

    code = "FAILED_PRECONDITION"


class ProcessGone(BackendError):
    """The process no longer exists. Reported as *gone*, never as a group failure."""

    code = "NOT_FOUND"


class NoCudaContext(BackendError):
    """The process exists but has no CUDA context (driver: NOT_INITIALIZED)."""

    code = "FAILED_PRECONDITION"


class LockTimeout(BackendError):
    """The lock did not drain the process's in-flight work in time (driver: NOT_READY).

    The process is left RUNNING, untouched.
    """

    code = "DEADLINE_EXCEEDED"


class IllegalState(BackendError):
    """The operation is not allowed in the process's current checkpoint state."""

    code = "FAILED_PRECONDITION"


class DeviceOutOfMemory(BackendError):
    """The device had no room (driver: OUT_OF_MEMORY).

    On the driver we measured, a restore that fails this way leaves the process
    CHECKPOINTED for good; that is why restores are admitted up front.
    """

    code = "RESOURCE_EXHAUSTED"


class NoRoom(DeviceOutOfMemory):
    """An allocation inside a hold did not fit and nothing more could be freed for it: the message
    names what holds the device (jobs and their bytes, processes no job registered)."""

    def __init__(self, message: str, *, need_bytes: int = 0, holders: list | None = None, **kw):
        super().__init__(message, **kw)
        self.need_bytes = need_bytes
        self.holders = list(holders or [])


class ContextLost(BackendError):
    """The process's device context cannot be brought back (state FAILED, or
    restore failing with OPERATING_SYSTEM after an earlier failed restore)."""

    code = "DATA_LOSS"


class SnapshotCorrupted(BackendError):
    """A host copy did not match the checksum recorded at checkpoint (simulator)."""

    code = "DATA_LOSS"


class AdmissionRefused(BackendError):
    """Refused before touching any process: the bytes would not fit."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, need_bytes: int, free_bytes: int, **kw):
        super().__init__(message, **kw)
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes


class HostMemoryRefused(AdmissionRefused):
    """A snapshot would not fit in free host memory (an OOM kill would lose the job)."""


class DeviceMemoryRefused(AdmissionRefused):
    """A restore would not fit in free device memory (a failed restore loses the job)."""


class SizeUnknown(AdmissionRefused):
    """The bytes to move cannot be known, so fitting them cannot be proven."""

    def __init__(self, message: str, **kw):
        super().__init__(message, need_bytes=-1, free_bytes=-1, **kw)
