"""Job-level freeze and thaw: lock a job's processes in place, and unlock them.

A strict group (``isolation="strict"``) hands the GPUs on without moving the
yielded job when the next one fits beside it (an elided handoff), but the
yielded job must run nothing there until it acquires again: a lease lock does
not stop a stray kernel, the GPU checks no token. The driver's process lock
does (``cuCheckpointProcessLock``, ~0.5 ms; every CUDA call of the process then
waits), and so does the simulator's (every device operation waits). Nothing is
copied: the memory stays on the device, and a later snapshot of a frozen
process starts from LOCKED (the lock is the first step of a checkpoint anyway).

The lock goes to the node's checkpoint backend even for a cooperative or
app-endpoint worker (``CompositeBackend.base``): its own pause would release
memory, which an elided handoff must not do.

Per process, as ``ops`` does for snapshots: GONE is no error; a process with
no device context (NO_CUDA) is SKIPPED (it can run nothing on a GPU); one
already in the target state is ALREADY; a parked one (CHECKPOINTED) is left
alone (it runs nothing either); a lock that times out leaves the process
running (FAILED, with the backend's words).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import structlog

from timeslice.nodeagent.backends.base import Backend, ProcState
from timeslice.nodeagent.backends.ops import (
    DEFAULT_LOCK_TIMEOUT_MS,
    JobResult,
    Outcome,
    PidResult,
    _failure,
    _parallel,
    _per_pid,
)

log = structlog.get_logger(__name__)

_AT_REST = (ProcState.GONE, ProcState.NO_CUDA, ProcState.CHECKPOINTED, ProcState.PARTIAL)


def _base(backend: Backend) -> Backend:
    return getattr(backend, "base", backend)


def freeze_processes(backend: Backend, pids: Sequence[int], *,
                     lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> JobResult:
    """Lock every running pid of a job, in parallel. Never raises for a pid's failure."""
    if lock_timeout_ms <= 0:
        raise ValueError("lock_timeout_ms must be positive: an unbounded lock can wedge the agent")
    return _each("freeze", backend, pids, ProcState.RUNNING, ProcState.LOCKED,
                 lambda pid: _base(backend).lock(pid, lock_timeout_ms))


def thaw_processes(backend: Backend, pids: Sequence[int]) -> JobResult:
    """Unlock every locked pid of a job, in parallel. Never raises for a pid's failure."""
    return _each("thaw", backend, pids, ProcState.LOCKED, ProcState.RUNNING, _base(backend).unlock)


def _each(op: str, backend: Backend, pids: Sequence[int], start: ProcState, target: ProcState, act) -> JobResult:
    t0 = time.monotonic()
    pids = list(dict.fromkeys(pids))

    def one(pid: int) -> PidResult:
        t = time.monotonic()
        before = backend.get_state(pid)
        if before is target:
            return PidResult(pid, Outcome.ALREADY, before, before)
        if before is ProcState.GONE:
            return PidResult(pid, Outcome.GONE, before, before)
        if before in _AT_REST:
            return PidResult(pid, Outcome.SKIPPED, before, before)
        if before is not start:
            return PidResult(pid, Outcome.FAILED, before, before, error=f"cannot {op} a process in state {before}",
                             error_code="FAILED_PRECONDITION")
        try:
            act(pid)
        except Exception as exc:
            return _failure(backend, pid, before, exc, t)
        return PidResult(pid, Outcome.DONE, before, target, elapsed_ms=(time.monotonic() - t) * 1000)

    result = JobResult(op, _parallel(one, pids) if pids else [], (time.monotonic() - t0) * 1000)
    log.info(f"{op}_done", pids=pids, ok=result.ok, elapsed_ms=round(result.elapsed_ms, 2),
             per_pid=_per_pid(result), backend=backend.name)
    return result
