"""Direct operations: Snapshot / Restore asked over gRPC, outside the orchestrator.

``submit`` checks the request (ids, pids, admission) and answers at once with
an operation id; the op then runs in the background through the same runner
(and per-job lock) as the intents, and ``get`` reports it. The job's status in
etcd is kept truthful afterwards, so the leader's picture of the node stays
right: where the job has an intent-answering status, only its state and
figures change; otherwise the status records the direct op (intent_revision 0).
The last ``keep`` operations are remembered (in memory: an operation id does
not survive an agent restart; the processes' state does).
"""
from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from timeslice.common.errors import InvalidIdError, TimesliceError
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.nodeagent import intents as I
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.jobs import LocalJobs, load_status
from timeslice.nodeagent.processes import JobProcesses
from timeslice.nodeagent.protected import protected_reason
from timeslice.nodeagent.reporter import Reporter
from timeslice.nodeagent.runner import Runner, RunResult
from timeslice.nodeagent.upkeep import Upkeep

log = structlog.get_logger(__name__)

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
MAX_PID = 2**22
MAX_PIDS_PER_REQUEST = 64     # a job's processes on one node; bounds the agent's work per call


class UnknownOperation(TimesliceError):
    code = "NOT_FOUND"


class NoProcesses(TimesliceError):
    code = "NOT_FOUND"


class NotJobsProcess(TimesliceError):
    """A named pid is not a registered worker of the named job (or must never be touched)."""

    code = "PERMISSION_DENIED"


class AgentStopping(TimesliceError):
    code = "UNAVAILABLE"


@dataclass
class Operation:
    operation_id: str
    op: str
    job_id: str
    state: str = PENDING
    bytes: int = 0
    elapsed_ms: float = 0.0
    error: str = ""
    pids: list[int] = field(default_factory=list)


class Operations:
    def __init__(self, node: str, runner: Runner, processes: JobProcesses, jobs: LocalJobs, reporter: Reporter,
                 upkeep: Upkeep, stopping: asyncio.Event, keep: int = 1000):
        """``stopping``: set when the agent stops (no new operation is taken)."""
        self.node, self.runner, self.processes, self.jobs = node, runner, processes, jobs
        self.reporter, self.upkeep, self.stopping = reporter, upkeep, stopping
        self.keep = keep
        self._ops: OrderedDict[str, Operation] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    def get(self, operation_id: str) -> Operation:
        op = self._ops.get(operation_id)
        if op is None:
            raise UnknownOperation(f"unknown operation {operation_id!r} (ids do not survive an agent restart)")
        return op

    async def submit(self, op: str, job: str, pids: list[int]) -> Operation:
        """Check and start a direct op on ``job``'s processes here (``pids``: some of them; none: all).

        Only registered workers of ``job`` (or processes the agent itself moved
        for ``job``) are acted on: a caller names a job, never a stranger's pid.
        """
        check_id("job", job)
        if len(pids) > MAX_PIDS_PER_REQUEST:
            raise InvalidIdError(f"limit max_pids_per_request: {len(pids)} pids named, at most "
                                 f"{MAX_PIDS_PER_REQUEST}")
        bad = [p for p in pids if not 0 < p <= MAX_PID]
        if bad:
            raise InvalidIdError(f"pids must be in 1..{MAX_PID}, got {bad[:8]}")
        if self.stopping.is_set():
            raise AgentStopping("the agent is stopping; retry on its successor")
        runner = self.runner
        registered, remembered = await self.processes.pids(job)
        if pids:
            chosen = sorted(set(pids))
            pic = await runner.picture(chosen)
            gone = [p for p, s in pic.states.items() if s is ProcState.GONE]
            if gone:
                raise NoProcesses(f"no such process on node {self.node}: {gone[:8]}")
            strangers = sorted(set(chosen) - set(registered) - set(remembered))
            if strangers:
                raise NotJobsProcess(f"pid(s) {strangers[:8]} are not registered workers of job {job!r} on node "
                                     f"{self.node}; the agent acts only on a job's own registered processes")
        else:
            pic = await runner.picture(registered, remembered)
            chosen = pic.live_pids
            if not chosen:
                raise NoProcesses(f"job {job!r} has no live registered process on node {self.node}; "
                                  "register its workers first")
        for p in chosen:
            why = protected_reason(p)
            if why:
                raise NotJobsProcess(f"pid {p} is never snapshotted or restored: {why}")
        # Refuse up front what the op would refuse: RESOURCE_EXHAUSTED, nothing touched.
        await asyncio.to_thread(runner.admit, op, chosen)
        o = Operation(uuid.uuid4().hex, op, job, pids=chosen)
        self._ops[o.operation_id] = o
        while len(self._ops) > self.keep:
            self._ops.popitem(last=False)
        t = asyncio.create_task(self._run(o), name=f"direct-{o.operation_id[:8]}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        log.info("direct_op_submitted", operation=o.operation_id, op=op, job=job, pids=chosen)
        return o

    async def _run(self, o: Operation) -> None:
        try:
            async with self.runner.lock(o.job_id):
                o.state = RUNNING
                rr = await self.runner.run(o.op, o.job_id, o.pids, "direct")
                o.bytes, o.elapsed_ms = rr.bytes_moved, round(rr.elapsed_ms, 3)
                o.error = rr.result.error
                if rr.outcome == R.PROCESS_GONE:
                    o.error = "the processes are gone"
                o.state = DONE if rr.outcome == R.OK else FAILED
                await self._record(o, rr)
        except asyncio.CancelledError:
            o.state, o.error = FAILED, "the agent stopped during the operation"
            raise
        except Exception as e:  # reported through GetOperation
            log.exception("direct_op_failed", operation=o.operation_id)
            if o.state != DONE:
                o.state, o.error = FAILED, f"{type(e).__name__}: {e}"
        log.info("direct_op_done", operation=o.operation_id, op=o.op, job=o.job_id, state=o.state,
                 bytes=o.bytes, elapsed_ms=o.elapsed_ms, error=o.error)

    async def _record(self, o: Operation, rr: RunResult) -> None:
        """Bring the job's status in etcd (and the liveness key) in line with what the op did."""
        skv = self.jobs.status_kv(o.job_id)
        old = load_status(skv.value) if skv else None
        if old is not None and old.intent_revision:
            new = I.corrected(old, rr.after)
        else:
            new = R.StatusValue(
                state=rr.after.state, job=o.job_id, op=o.op, outcome=rr.outcome, bytes=o.bytes,
                device_bytes=rr.after.device_bytes, elapsed_ms=o.elapsed_ms, error=o.error,
                pids=rr.after.live_pids, updated_ms=R.now_ms())
        if new is not None:
            await self.reporter.correct(o.job_id, new, skv.mod_revision if skv else 0)
        await self.upkeep.refresh()

    async def stop(self, grace: float = 30.0) -> None:
        """Let the operations in flight finish (up to ``grace`` s), then cancel the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
