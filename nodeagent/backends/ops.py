"""Job-level snapshot and restore: several processes, in parallel, with the safety rules.

This is what the agent loop calls for an intent. One job may have several
processes on a node (one per GPU, typically); each is driven in its own thread
because the copies are independent and the driver scales with them (README,
"Node agent on an H200": two processes checkpoint 1.9x faster together than one).

The rules, per process:

* admission first, for the whole job, before any process is touched: the
  snapshot must fit in free host memory (``HostMemory``), the restore in free
  device memory, device by device (``admit_restore``); otherwise every pid is
  REFUSED and nothing changes;
* a process that does not exist is GONE, not an error of the job;
* already in the target state (checkpointed for a snapshot, running for a
  restore) is ALREADY: reported done, nothing redone (idempotent, so a retried
  intent or a restarted agent is harmless);
* lock with a timeout; a lock timeout leaves the process running (FAILED);
* a checkpoint that fails after the lock unlocks the process again, and the
  result says whether that unlock worked;
* half-finished work found on a process (LOCKED from a crashed agent) is
  finished: snapshot checkpoints it, restore unlocks it;
* a cooperative worker paused in part (PARTIAL) is paused further by a
  snapshot (what is still resident) and resumed by a restore.

``JobResult.ok`` is true when every process ended in the target state or is
gone; the agent reports ``JobResult.error`` verbatim otherwise.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from timeslice.common import device_errors as e
from timeslice.nodeagent.backends.base import Backend, ProcState
from timeslice.nodeagent.hostmem import HostMemory, admit_restore

log = structlog.get_logger(__name__)

DEFAULT_LOCK_TIMEOUT_MS = 10_000  # long enough for a training step's queued kernels to drain
# On a device, or paused in part (a cooperative worker's regions left there): a snapshot has work.
_TO_SNAPSHOT = (ProcState.RUNNING, ProcState.LOCKED, ProcState.PARTIAL)
_PARKED = (ProcState.CHECKPOINTED, ProcState.PARTIAL)                 # a restore has work


class Outcome(str, enum.Enum):
    DONE = "done"            # this call moved the process to the target state
    ALREADY = "already"      # it was there already; nothing redone
    GONE = "gone"            # the process does not exist
    SKIPPED = "skipped"      # no CUDA context in it: nothing to move
    REFUSED = "refused"      # admission refused the job; the process was not touched
    FAILED = "failed"        # see error; state_after says where it was left

    def __str__(self) -> str:
        return self.value


@dataclass
class PidResult:
    pid: int
    outcome: Outcome
    state_before: ProcState
    state_after: ProcState
    bytes: int = 0
    elapsed_ms: float = 0.0
    error: str = ""
    error_code: str = ""     # the exception's gRPC-style code, e.g. DEADLINE_EXCEEDED

    @property
    def ok(self) -> bool:
        return self.outcome in (Outcome.DONE, Outcome.ALREADY, Outcome.GONE, Outcome.SKIPPED)


@dataclass
class JobResult:
    op: str                          # "snapshot" | "restore"
    results: list[PidResult] = field(default_factory=list)
    elapsed_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def refused(self) -> bool:
        return any(r.outcome is Outcome.REFUSED for r in self.results)

    @property
    def all_gone(self) -> bool:
        return bool(self.results) and all(r.outcome is Outcome.GONE for r in self.results)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.results)

    @property
    def error(self) -> str:
        return "; ".join(f"pid {r.pid}: {r.error}" for r in self.results if not r.ok)

    def by_pid(self) -> dict[int, PidResult]:
        return {r.pid: r for r in self.results}


def _refuse_all(op: str, pids: Sequence[int], states: dict[int, ProcState], exc: e.BackendError, t0: float):
    log.warning("admission_refused", op=op, pids=list(pids), error=str(exc))
    res = [PidResult(p, Outcome.REFUSED, states[p], states[p], error=str(exc), error_code=exc.code) for p in pids]
    return JobResult(op, res, (time.monotonic() - t0) * 1000)


def _per_pid(result: JobResult, limit: int = 64) -> list[dict]:
    """Each process's outcome, bytes and time, for the log (per-GPU swap times); bounded."""
    return [{"pid": r.pid, "outcome": str(r.outcome), "bytes": r.bytes, "ms": round(r.elapsed_ms, 1)}
            for r in result.results[:limit]]


def _parallel(fn: Callable[[int], PidResult], pids: Sequence[int]) -> list[PidResult]:
    if len(pids) == 1:
        return [fn(pids[0])]
    with ThreadPoolExecutor(max_workers=len(pids), thread_name_prefix="ckpt") as pool:
        return list(pool.map(fn, pids))


def _failure(backend: Backend, pid: int, before: ProcState, exc: Exception, t: float) -> PidResult:
    after = backend.get_state(pid)
    if isinstance(exc, e.ProcessGone) or after is ProcState.GONE:
        return PidResult(pid, Outcome.GONE, before, ProcState.GONE, elapsed_ms=(time.monotonic() - t) * 1000)
    code = exc.code if isinstance(exc, e.BackendError) else "INTERNAL"
    return PidResult(pid, Outcome.FAILED, before, after, error=str(exc), error_code=code,
                     elapsed_ms=(time.monotonic() - t) * 1000)


def snapshot_processes(backend: Backend, pids: Sequence[int], *, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
                       host: HostMemory | None = None) -> JobResult:
    """Checkpoint every pid of a job to host memory, in parallel. Never raises for a pid's failure."""
    if lock_timeout_ms <= 0:
        raise ValueError("lock_timeout_ms must be positive: an unbounded lock can wedge the agent")
    t0 = time.monotonic()
    host = host or HostMemory()
    pids = list(dict.fromkeys(pids))
    states = {p: backend.get_state(p) for p in pids}
    todo = [p for p in pids if states[p] in _TO_SNAPSHOT]
    need = 0
    for p in todo:
        n = backend.host_bytes_needed(p)
        if n is None:
            return _refuse_all("snapshot", pids, states, e.SizeUnknown(
                f"snapshot refused: device memory of pid {p} is unknown, so fitting it in host memory "
                "cannot be proven", pid=p), t0)
        need += n
    try:
        host.admit_snapshot(need)
    except e.AdmissionRefused as exc:
        return _refuse_all("snapshot", pids, states, exc, t0)

    def one(pid: int) -> PidResult:
        t = time.monotonic()
        before = states[pid]
        if before is ProcState.CHECKPOINTED:
            return PidResult(pid, Outcome.ALREADY, before, before, bytes=backend.snapshot_bytes(pid) or 0)
        if before is ProcState.GONE:
            return PidResult(pid, Outcome.GONE, before, before)
        if before is ProcState.NO_CUDA:
            return PidResult(pid, Outcome.SKIPPED, before, before)
        if before not in _TO_SNAPSHOT:
            return PidResult(pid, Outcome.FAILED, before, before, error=f"cannot snapshot a process in state {before}",
                             error_code="FAILED_PRECONDITION")
        try:
            if before is ProcState.RUNNING:
                backend.lock(pid, lock_timeout_ms)
        except Exception as exc:  # every failure becomes this pid's report
            return _failure(backend, pid, before, exc, t)
        try:
            nbytes = backend.checkpoint(pid)
        except Exception as exc:
            # Never leave a process wedged: give it its device back, then report.
            undo = ""
            if backend.get_state(pid) is ProcState.LOCKED:
                try:
                    backend.unlock(pid)
                except Exception as unlock_exc:
                    undo = f"; unlock after the failed checkpoint also failed: {unlock_exc}"
            res = _failure(backend, pid, before, exc, t)
            res.error += undo
            if res.outcome is Outcome.GONE:
                log.info("checkpoint_gone", pid=pid, why="the process exited during its snapshot")
            else:
                log.error("checkpoint_failed", pid=pid, error=res.error, state_after=str(res.state_after))
            return res
        return PidResult(pid, Outcome.DONE, before, ProcState.CHECKPOINTED, bytes=nbytes,
                         elapsed_ms=(time.monotonic() - t) * 1000)

    # While the copies run, what was admitted counts as taken: a pool admitted meanwhile must not count
    # the same free memory (nodeagent/hostmem.py).
    with host.promised(need):
        result = JobResult("snapshot", _parallel(one, pids), (time.monotonic() - t0) * 1000)
    log.info("snapshot_done", pids=pids, ok=result.ok, bytes=result.bytes, elapsed_ms=round(result.elapsed_ms, 1),
             per_pid=_per_pid(result),
             backend=backend.name)
    return result


def restore_processes(backend: Backend, pids: Sequence[int], *,
                      known_bytes: dict[int, int] | None = None,
                      headroom_bytes: int | None = None) -> JobResult:
    """Restore and unlock every pid of a job, in parallel, if the devices have room for all of it.

    ``known_bytes`` (pid -> total bytes, e.g. from the agent's etcd status)
    stands in for a pid whose backend record is missing; without a per-device
    breakdown it must fit on *every* device (the conservative reading).
    """
    t0 = time.monotonic()
    pids = list(dict.fromkeys(pids))
    states = {p: backend.get_state(p) for p in pids}
    headroom = backend.restore_headroom_bytes if headroom_bytes is None else headroom_bytes
    free = backend.device_free()
    need: dict[str, int] = {}
    for p in (p for p in pids if states[p] in _PARKED):
        usage = backend.snapshot_usage(p)
        if usage is None and known_bytes and p in known_bytes:
            usage = {dev: known_bytes[p] for dev in (free or {"?": 0})}
        if usage is None:
            return _refuse_all("restore", pids, states, e.SizeUnknown(
                f"restore refused: no recorded snapshot size for pid {p}; a restore that does not fit "
                "loses the process", pid=p), t0)
        for dev, n in usage.items():
            need[dev] = need.get(dev, 0) + n
    try:
        admit_restore(need, free, headroom)
    except e.AdmissionRefused as exc:
        return _refuse_all("restore", pids, states, exc, t0)

    def one(pid: int) -> PidResult:
        t = time.monotonic()
        before = states[pid]
        if before is ProcState.RUNNING:
            return PidResult(pid, Outcome.ALREADY, before, before)
        if before is ProcState.GONE:
            return PidResult(pid, Outcome.GONE, before, before)
        if before is ProcState.NO_CUDA:
            return PidResult(pid, Outcome.SKIPPED, before, before)
        if before not in (*_PARKED, ProcState.LOCKED):
            return PidResult(pid, Outcome.FAILED, before, before, error=f"cannot restore a process in state {before}",
                             error_code="DATA_LOSS" if before is ProcState.FAILED else "FAILED_PRECONDITION")
        nbytes = 0
        try:
            if before in _PARKED:
                nbytes = backend.restore(pid)
            backend.unlock(pid)
        except Exception as exc:
            res = _failure(backend, pid, before, exc, t)
            log.error("restore_failed", pid=pid, error=res.error, state_after=str(res.state_after))
            return res
        return PidResult(pid, Outcome.DONE, before, ProcState.RUNNING, bytes=nbytes,
                         elapsed_ms=(time.monotonic() - t) * 1000)

    result = JobResult("restore", _parallel(one, pids), (time.monotonic() - t0) * 1000)
    log.info("restore_done", pids=pids, ok=result.ok, bytes=result.bytes, elapsed_ms=round(result.elapsed_ms, 1),
             per_pid=_per_pid(result),
             backend=backend.name)
    return result

