"""Runs a job's snapshot, restore, freeze or thaw on the backend: one op per job at a time, jobs in parallel.

Both the intent loop and the direct gRPC API come through here, so they share
the per-job lock (a direct Restore can never interleave with an intent's
snapshot of the same job) and the metrics. The per-process parallelism and
the safety rules (admission, lock timeout, unlock on failure, gone processes)
are ``nodeagent.backends.ops``; this adds the job-level one: a snapshot that
failed for some processes after others were checkpointed restores those
again, so a failed snapshot leaves the job whole and running.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from timeslice.common.device_errors import AdmissionRefused, SizeUnknown
from timeslice.common.server import records as R
from timeslice.nodeagent import picture as P
from timeslice.nodeagent.backends import freezing, ops
from timeslice.nodeagent.backends.base import Backend, ProcState
from timeslice.nodeagent.hostmem import HostMemory, admit_restore
from timeslice.nodeagent.intents import moved_bytes, outcome_of
from timeslice.nodeagent.metrics import Metrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RunResult:
    result: ops.JobResult
    rollback: ops.JobResult | None
    after: P.Picture
    elapsed_ms: float

    @property
    def outcome(self) -> str:
        return outcome_of(self.result)

    @property
    def bytes_moved(self) -> int:
        return moved_bytes(self.result, self.rollback)


class Runner:
    def __init__(self, backend: Backend, host: HostMemory, lock_timeout_ms: int, metrics: Metrics):
        self.backend, self.host, self.metrics = backend, host, metrics
        self.lock_timeout_ms = lock_timeout_ms
        self._locks: dict[str, asyncio.Lock] = {}
        self.driven: set[str] = set()           # jobs an intent driver works on (nodeagent/driver.py)

    def lock(self, job: str) -> asyncio.Lock:
        """The job's op lock: at most one op per job at a time."""
        return self._locks.setdefault(job, asyncio.Lock())

    def busy(self, job: str) -> bool:
        """An op (intent or direct) runs on ``job``, or an intent driver works on it: its status is theirs."""
        lk = self._locks.get(job)
        return job in self.driven or (lk is not None and lk.locked())

    async def picture(self, pids: Sequence[int], remembered: Sequence[int] = ()) -> P.Picture:
        return await asyncio.to_thread(P.take, self.backend, pids, remembered)

    def admit(self, op: str, pids: Sequence[int]) -> None:
        """Admission for the whole job, as the op itself will do it; raises AdmissionRefused.

        Blocking. The direct API calls it up front so that a refusal is a
        RESOURCE_EXHAUSTED answer rather than a failed operation.
        """
        if op == R.SNAPSHOT:
            host_need = 0
            for pid in pids:
                if self.backend.get_state(pid) in (ProcState.RUNNING, ProcState.LOCKED, ProcState.PARTIAL):
                    n = self.backend.host_bytes_needed(pid)
                    if n is None:
                        raise SizeUnknown(f"snapshot refused: device memory of pid {pid} is unknown", pid=pid)
                    host_need += n
            self.host.admit_snapshot(host_need)
            return
        need: dict[str, int] = {}
        for pid in pids:
            if self.backend.get_state(pid) in (ProcState.CHECKPOINTED, ProcState.PARTIAL):
                usage = self.backend.snapshot_usage(pid)
                if usage is None:
                    raise SizeUnknown(f"restore refused: no recorded snapshot size for pid {pid}", pid=pid)
                for dev, n in usage.items():
                    need[dev] = need.get(dev, 0) + n
        admit_restore(need, self.backend.device_free(), self.backend.restore_headroom_bytes)

    def _run(self, op: str, pids: Sequence[int]) -> tuple[ops.JobResult, ops.JobResult | None]:
        if op == R.RESTORE:
            return ops.restore_processes(self.backend, pids), None
        if op == R.FREEZE:
            return freezing.freeze_processes(self.backend, pids, lock_timeout_ms=self.lock_timeout_ms), None
        if op == R.THAW:
            return freezing.thaw_processes(self.backend, pids), None
        res = ops.snapshot_processes(self.backend, pids, lock_timeout_ms=self.lock_timeout_ms, host=self.host)
        done = [r.pid for r in res.results if r.outcome is ops.Outcome.DONE]
        if res.ok or not done:
            return res, None
        # Part of the job is in host memory, part failed: the job cannot run
        # like that. Bring the checkpointed part back (its room on the device
        # was just freed by these very processes).
        log.warning("snapshot_rollback", pids=done, error=res.error)
        return res, ops.restore_processes(self.backend, done)

    async def run(self, op: str, job: str, pids: Sequence[int], source: str, *, isolation: str = "",
                  need_bytes: int = 0) -> RunResult:
        """Run ``op`` on ``pids``; the caller holds ``lock(job)``. Never raises for a process's failure.

        ``isolation`` (the group's policy) and ``need_bytes`` (device bytes the
        incoming job needs here; 0 = all) shape cooperative swaps
        (``backends.composite``); a whole-process checkpoint ignores them.
        """
        self.metrics.inflight.inc()
        t0 = time.monotonic()
        try:
            try:
                await asyncio.to_thread(self.backend.prepare, op, list(pids), isolation, need_bytes)
                res, rollback = await asyncio.to_thread(self._run, op, list(pids))
            except Exception as e:  # a bug or an I/O error becomes the job's report
                log.exception("op_crashed", op=op, job=job, pids=list(pids))
                kind = ops.Outcome.REFUSED if isinstance(e, AdmissionRefused) else ops.Outcome.FAILED
                res, rollback = ops.JobResult(op, [ops.PidResult(p, kind, ProcState.UNKNOWN, ProcState.UNKNOWN,
                                                                 error=f"{type(e).__name__}: {e}")
                                                   for p in pids]), None
            elapsed = (time.monotonic() - t0) * 1000
            after = await self.picture(pids)
        finally:
            self.backend.finish(list(pids))      # prepare's pair, whatever happened
            self.metrics.inflight.dec()
        rr = RunResult(res, rollback, after, elapsed)
        self.metrics.ops.labels(op, rr.outcome, source).inc()
        self.metrics.op_seconds.labels(op).observe(elapsed / 1000)
        self.metrics.bytes_moved.labels(op).inc(rr.bytes_moved)
        return rr
