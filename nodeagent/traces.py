"""The node agent's spans of a handoff (opt-in, common/tracing.py): one per process it moved.

For a snapshot or restore intent that belongs to a traced handoff, each process the op
touched gets a span ``nodeagent.snapshot`` / ``nodeagent.restore`` (bytes, backend, the
GPUs it has memory on, outcome, time), the child of the leader's ``lockd.intent`` span:
the agent finds the trace in the queue entry whose token the intent carries (one read,
only while traces are on) and derives the intent span's id as the leader does
(``tracing.intent_span_id``). The processes of one op run in parallel, so each span
starts when the op did and lasts that process's own time.
"""
from __future__ import annotations

from timeslice.common import tracing
from timeslice.common.errors import TimesliceError
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.keys import Keys


async def trace_of(client, keys: Keys, group: str, token: int) -> str:
    """The traceparent the handoff of ``token`` carries ("" if none, or the entry is gone)."""
    try:
        # Why: the intent names the grant it serves by token; that job's queue entry (create
        # revision = token) holds the trace its Acquire started. Read only while tracing.
        r = await client.range(ops.range_req(keys.queue(group), prefix=True))
    except TimesliceError:
        return ""
    for kv in r.kvs:
        if kv.create_revision == token:
            try:
                return R.QueueValue.load(kv.value).trace
            except (ValueError, TypeError):
                return ""
    return ""


async def op_spans(client, keys: Keys, node: str, backend: str, intent, before, run, start_ns: int) -> None:
    """Record the spans of ``run`` (a runner.RunResult) for ``intent``; nothing when traces are off."""
    if not tracing.enabled() or intent.value is None or intent.op not in (R.SNAPSHOT, R.RESTORE):
        return
    trace = await trace_of(client, keys, intent.group, intent.token)
    if not trace:
        return
    parent = tracing.child_of(trace, tracing.intent_span_id(trace, keys.intent(node, intent.job), intent.revision))
    done = [(run.result.op, r) for r in run.result.results]
    done += [(R.RESTORE, r) for r in (run.rollback.results if run.rollback else [])]   # a failed snapshot's undo
    for op, res in done:
        gpus = sorted((before.usage.get(res.pid) or {}) | (run.after.usage.get(res.pid) or {}))
        tracing.record(f"nodeagent.{op}",
                       start_ns=start_ns, end_ns=start_ns + int(res.elapsed_ms * 1e6), parent=parent,
                       attributes={"timeslice.job": intent.job, "timeslice.group": intent.group,
                                   "timeslice.token": intent.token, "timeslice.node": node,
                                   "timeslice.pid": res.pid, "timeslice.bytes": res.bytes,
                                   "timeslice.backend": backend, "timeslice.gpus": ",".join(gpus),
                                   "timeslice.outcome": res.outcome.value},
                       error=res.error if not res.ok else "")
