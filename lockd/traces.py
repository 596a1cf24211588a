"""lockd's spans of a handoff (opt-in, common/tracing.py): the Acquire, its wait in the queue,
and, on the leader, the handoff with its plan and each intent.

* The replica serving an Acquire opens ``lockd.acquire`` (a server span continuing the
  client's ``traceparent``) and ``lockd.queue_wait`` under it; the queue entry it writes
  carries that span's traceparent (``QueueValue.trace``), which is how the rest of the
  handoff joins the same trace.
* The leader watches its mirror (``HandoffTraces.on_batch``, like the history) and, when
  the grant is written, records ``lockd.handoff`` (from the moment the job's turn came, or
  its first swap intent, to the grant) with ``lockd.plan`` (until the first intent, or
  the grant when nothing moved), one ``lockd.intent`` per intent (written to answered;
  its id from ``tracing.intent_span_id``, so the agent's spans nest under it) and
  ``lockd.grant``. Nothing is added to the scheduler's path: the spans are made from
  what the mirror shows, with its times.

Attributes: ``timeslice.job``, ``.group``, ``.token``, ``.node``, ``.replica``, ``.op``...
Bounded: at most ``MAX_OPEN`` handoffs followed at once, ``MAX_INTENTS`` intents each.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog

from timeslice.common import tracing
from timeslice.common.server import records as R
from timeslice.common.server.etcd.watch import WatchEvent
from timeslice.common.server.keys import Keys
from timeslice.lockd import priority as PR

log = structlog.get_logger(__name__)

MAX_OPEN = 4096
MAX_INTENTS = 256


@contextlib.contextmanager
def acquire_span(context, req, replica: str) -> Iterator[object | None]:
    """``lockd.acquire`` around an Acquire (None, at no cost, when traces are off)."""
    if not tracing.enabled():
        yield None
        return
    parent = tracing.from_metadata(context.invocation_metadata())
    with tracing.span("lockd.acquire", kind="server", parent=parent,
                      attributes={"timeslice.job": req.job_id, "timeslice.group": req.group_id,
                                  "timeslice.replica": replica}) as s:
        yield s


def granted(span, got) -> None:
    """The grant's figures on ``lockd.acquire``, and ``lockd.queue_wait`` (enqueue to grant) under it."""
    if span is None:
        return
    g = got.grant
    attrs = {"timeslice.token": got.token, "timeslice.leader_epoch": g.leader_epoch,
             "timeslice.restored": g.restored, "timeslice.elided": g.elided, "timeslice.bytes_moved": g.bytes_moved}
    tracing.set_attributes(span, attrs)
    now = time.time_ns()
    tracing.record("lockd.queue_wait", start_ns=now - int(got.waited_ms * 1e6), end_ns=now,
                   parent=tracing.traceparent(), attributes={"timeslice.token": got.token,
                                                              "timeslice.waited_ms": got.waited_ms})


@dataclass
class _Intent:
    key: bytes
    revision: int
    node: str
    job: str
    op: str
    written_ns: int
    answered_ns: int = 0
    outcome: str = ""
    bytes: int = 0
    elapsed_ms: float = 0.0
    error: str = ""


@dataclass
class _Handoff:
    group: str
    job: str
    token: int
    trace: str
    start_ns: int
    intents: dict[tuple[bytes, int], _Intent] = field(default_factory=dict)


class HandoffTraces:
    """The leader's view of each traced handoff, from the mirror's events to its spans."""

    def __init__(self, keys: Keys, index, replica: str):
        self.keys, self.index, self.replica = keys, index, replica
        self.open: dict[tuple[str, int], _Handoff] = {}
        self.granted: dict[str, set[int]] = {}     # group -> the holders' tokens whose handoffs were recorded

    def on_batch(self, events: list[WatchEvent], leading: bool) -> None:
        if not leading or not tracing.enabled():
            return
        try:
            self._on_batch(events)
        except Exception:  # a tracing bug must never stop the mirror that calls it
            log.exception("handoff_traces_failed")

    def _on_batch(self, events: list[WatchEvent]) -> None:
        now = time.time_ns()
        groups: set[str] = set()
        for ev in events:
            try:
                parts = self.keys.parse(ev.kv.key)
            except (ValueError, UnicodeDecodeError):
                continue
            if parts[0] == "groups" and len(parts) >= 3:
                groups.add(parts[1])
            elif parts[0] == "nodes" and len(parts) == 4 and ev.is_put:
                if parts[2] == "intents":
                    self._on_intent(parts[1], ev, now)
                elif parts[2] == "status":
                    self._on_answer(parts[1], parts[3], ev, now)
        for g in groups | {g for g, _ in self.open}:
            self._look_at(g, now, g in groups)

    # -- what the mirror shows ----------------------------------------------------------------
    def _entry(self, group: str, token: int) -> tuple[str, R.QueueValue] | None:
        gs = self.index.groups.get(group)
        for job, kv in (gs.queue.items() if gs is not None else ()):
            if kv.create_revision == token:
                try:
                    return job, R.QueueValue.load(kv.value)
                except (ValueError, TypeError):
                    return None
        return None

    def _follow(self, group: str, token: int, now: int) -> _Handoff | None:
        h = self.open.get((group, token))
        if h is None and len(self.open) < MAX_OPEN:
            found = self._entry(group, token)
            if found is not None and found[1].trace:
                h = self.open[(group, token)] = _Handoff(group, found[0], token, found[1].trace, now)
        return h

    def _on_intent(self, node: str, ev: WatchEvent, now: int) -> None:
        try:
            v = R.IntentValue.load(ev.kv.value)
        except (ValueError, TypeError):
            return
        h = self._follow(v.group, v.token, now) if v.group and v.token > 0 else None
        if h is not None and len(h.intents) < MAX_INTENTS:
            # The writer's clock, not the moment the mirror showed it: an agent may start before that.
            written = min(now, v.issued_ms * 1_000_000) if v.issued_ms else now
            h.start_ns = min(h.start_ns, written)
            h.intents.setdefault((ev.kv.key, ev.kv.mod_revision),
                                 _Intent(ev.kv.key, ev.kv.mod_revision, node, v.job, v.op, written))

    def _on_answer(self, node: str, job: str, ev: WatchEvent, now: int) -> None:
        try:
            st = R.StatusValue.load(ev.kv.value)
        except (ValueError, TypeError):
            return
        if not st.outcome or st.intent_revision <= 0:
            return
        want = (self.keys.intent(node, job), st.intent_revision)
        for h in self.open.values():
            it = h.intents.get(want)
            if it is not None and not it.answered_ns:
                answered = min(now, st.updated_ms * 1_000_000) if st.updated_ms else now
                it.answered_ns, it.outcome, it.bytes = max(answered, it.written_ns), st.outcome, st.bytes
                it.elapsed_ms, it.error = st.elapsed_ms, st.error
                return

    def _look_at(self, group: str, now: int, changed: bool) -> None:
        gs = self.index.groups.get(group)
        grants: dict[int, R.GrantValue] = {}          # token -> grant: every holder (a fit group: several)
        for kv in (gs.holders().values() if gs is not None else ()):
            try:
                gv = R.GrantValue.load(kv.value)
            except (ValueError, TypeError):
                continue
            grants[gv.token] = gv
        head = PR.planned_head(gs, R.now_ms()) if gs is not None else None   # priority groups: by class
        head_token = head[1].create_revision if head else 0
        done = self.granted.get(group, set()) & set(grants)
        for token, grant in grants.items():
            if changed and token not in done:
                h = self._follow(group, token, now)       # a direct handoff opens and closes here
                if h is not None:
                    self._close(h, now, grant)
                    done.add(token)
        if gs is None:
            self.granted.pop(group, None)
        else:
            self.granted[group] = done
        if head_token and head_token not in grants:
            self._follow(group, head_token, now)           # its turn came: the handoff starts
        for (gname, token), h in list(self.open.items()):
            if gname == group and token not in grants and self._entry(group, token) is None:
                self._close(h, now, None)                  # left the queue ungranted (failed, cancelled)

    # -- spans ----------------------------------------------------------------------------------
    def _close(self, h: _Handoff, now: int, grant: R.GrantValue | None) -> None:
        self.open.pop((h.group, h.token), None)
        if grant is not None and grant.granted_ms:              # the grant's writer's clock
            now = max(min(now, grant.granted_ms * 1_000_000), h.start_ns,
                      *(i.answered_ns for i in h.intents.values()))
        base = {"timeslice.job": h.job, "timeslice.group": h.group, "timeslice.token": h.token,
                "timeslice.replica": self.replica}
        attrs = dict(base)
        if grant is not None:
            attrs.update({"timeslice.leader_epoch": grant.leader_epoch, "timeslice.restored": grant.restored,
                          "timeslice.elided": grant.elided, "timeslice.bytes_moved": grant.bytes_moved})
        tp = tracing.record("lockd.handoff", start_ns=h.start_ns, end_ns=now, parent=h.trace, attributes=attrs,
                            error="" if grant is not None else "the job left the queue without a grant")
        first = min((i.written_ns for i in h.intents.values()), default=now)
        tracing.record("lockd.plan", start_ns=h.start_ns, end_ns=first, parent=tp,
                       attributes={**base, "timeslice.intents": len(h.intents)})
        for it in h.intents.values():
            tracing.record("lockd.intent", start_ns=it.written_ns, end_ns=it.answered_ns or now, parent=tp,
                           span_id=tracing.intent_span_id(h.trace, it.key, it.revision),
                           attributes={**base, "timeslice.node": it.node, "timeslice.op": it.op,
                                       "timeslice.target_job": it.job, "timeslice.outcome": it.outcome or "unanswered",
                                       "timeslice.bytes": it.bytes, "timeslice.elapsed_ms": it.elapsed_ms},
                           error=it.error if it.outcome not in ("", R.OK) else "")
        if grant is not None:
            tracing.record("lockd.grant", start_ns=now, end_ns=now, parent=tp, attributes=attrs)
