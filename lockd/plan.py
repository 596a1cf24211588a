"""The scheduler's decisions, sans-IO: state in, actions out.

``plan_group`` looks at one group (its queue, grant, the agents, intents and
statuses of its nodes, the jobs' workers) and says what the leader must write
next. It never performs I/O and never waits, so every branch is unit-tested
with hand-made states, and a new leader simply calls it again on what etcd
holds: every step is resumable because the state *is* the plan's input.

The swap for head job B (token t), per node of the group, GPU by GPU
(``timeslice.lockd.occupancy``: where each job has a device context, free bytes per GPU;
``lockd.residency``: running, partly paused, unknown, snapshotted):
  0. B's state unknown to the agent (a cooperative worker not reconnected to it)
     → restore intent for B first: the agent answers once it has seen B's memory
     back (or fails it with the reason); no grant before;
  1. jobs other than B resident on a GPU where B does not fit beside them (also
     one paused in part, or of unknown state) → snapshot intents for them
     (carrying t); wait for the agent's reports; a job that holds a group on
     those devices is never snapshotted: B waits; one this swap paused already
     and still in the way is asked for more (the rest of its regions after a
     selective pause, then its residue), and once nothing is left to take, B's
     restore goes to the agent (it admits on exact figures) or B fails in time;
  2. B snapshotted on the node → restore intent for B; wait;
  3. a strict group: every other job left on its GPUs frozen in place (lockd.strict);
     B frozen (by an earlier strict handoff) → thaw intent for B (beside the freezes); wait;
  4. every node settled → grant {B, t, epoch}.
In a group with priority classes (lockd.priority) B is the earliest waiter of the highest class
(aging aside); a B that overtakes an earlier waiter first raises the group's turns token (so the
overtaken re-key above it, and tokens stay increasing in grant order), and each grant counts itself.
A failed or refused step, a dead agent, or an agent silent past the swap
timeout fails B's Acquire with the reason; the group moves on to the next job.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace

from timeslice.common.server import records as R
from timeslice.lockd import footprints as FP
from timeslice.lockd import priority as PR
from timeslice.lockd import rekey as RK
from timeslice.lockd import strict as S
from timeslice.lockd.index import KV, GroupState, JobState, NodeState, status_of
from timeslice.lockd.occupancy import NodeView, is_protected, need_per_gpu
from timeslice.lockd.reasons import room_text, size_text
from timeslice.lockd.residency import (
    RESIDENT,
    may_checkpoint_rest,
    parked_left,
    residency,
    residue_holders,
    unfenced,
    unreported_memory,
)

# What the agent keeps free beside a restore (nodeagent/hostmem.py's DEFAULT_DEVICE_HEADROOM_BYTES; lockd
# imports nothing of the agent): a restore planned beside a residue's checkpoint must pass its admission.
RESTORE_HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True)
class Policy:
    swap_timeout_ms: int = 120_000        # an agent op not reported by then fails the swap
    device_margin_bytes: int = 0          # kept free beside a restored/elided job
    evict_unknown: bool = True            # footprint unknown (never ran, no hint): make room
    refused_retry_ms: int = 2_000         # pause before re-trying a restore the agent refused for room
    footprint: FP.FootprintPolicy = FP.DEFAULT_POLICY   # what a grant admits (lockd.footprints)


@dataclass(frozen=True)
class WriteIntent:
    node: str
    job: str
    op: str
    token: int
    expect_mod_revision: int              # 0: the intent key must be absent
    # snapshot: room the incoming job needs here (0: release all); advisory, so not part of equality
    need_bytes: int = field(default=0, compare=False)
    # "" = the group's isolation; "full" = also checkpoint what a cooperative pause left (its residue)
    isolation: str = ""
    # why it is written, for the log (which job needs how many bytes where, what is free); not compared
    reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class WriteGrant:
    job: str
    token: int
    lease: int
    restored: bool
    elided: bool
    bytes_moved: int
    # A priority group's grant also counts itself in the turns key, guarded by the key's mod revision
    # as planned (0: absent); -1: a FIFO group, no turns key. A fit group's grant is guarded by it
    # without writing it (``turns_next`` empty): a raise since the plan (a backfill's) makes it stale.
    turns_rev: int = field(default=-1, compare=False)
    turns_next: bytes = field(default=b"", compare=False)
    # A fit group's grant (lockd.fitplan): its own key ``grants/<job>``, guarded by the grants as planned
    # (no key under ``grants/`` written after ``holders_rev``: holders may only have left since).
    shared: bool = False
    exclusive: bool = False               # weighs the whole device
    backfilled: bool = False              # granted before an earlier waiter that does not fit yet
    # A backfill's head, as it was judged against (job, its entry's key): still queued there at the grant.
    ahead_of: str = field(default="", compare=False)
    ahead_token: int = field(default=0, compare=False)
    footprint: dict = field(default_factory=dict, compare=False)   # "<node>/<GPU>" -> admitted bytes
    holders_rev: int = field(default=0, compare=False)

    def stored(self, epoch: int) -> R.GrantValue:
        """The grant as stored (a fit group's with what it weighs; an exclusive group's as it always was)."""
        return R.GrantValue(self.job, self.token, epoch, self.restored, self.elided, self.bytes_moved, R.now_ms(),
                            footprint=dict(self.footprint) if self.shared else {},
                            exclusive=self.shared and self.exclusive, backfilled=self.backfilled)


@dataclass(frozen=True)
class RaiseTurns:
    """Priority groups: the head overtakes earlier waiters; before anything is done for it, the turns
    token goes up to its token (entries below re-key), guarded by the key's mod revision as planned."""

    token: int
    expect_mod_revision: int
    value: bytes = field(compare=False)


@dataclass(frozen=True)
class DropGrant:
    raw: bytes                            # the stale grant's exact value (compare-and-delete)
    job: str
    key: bytes = field(default=b"", compare=False)   # its key as mirrored (b"": the group's ``grant``)


@dataclass(frozen=True)
class FailWaiter:
    job: str
    token: int
    lease: int
    reason: str
    node: str = ""


Action = WriteIntent | WriteGrant | DropGrant | FailWaiter | RaiseTurns | RK.MoveOut | RK.MoveIn | RK.DropMarker


def pick_head(group: GroupState, spec: R.GroupSpec, nodes: dict[str, NodeState],
          now_ms: int, holders: Collection[str] = ()) -> tuple[tuple[str, KV] | None, PR.Head | None]:
    """(head, its priority decision): the FIFO head, or that of a priority group or a fit group
    (lockd.priority: by arrival, a fit group's holders left out)."""
    if not spec.priorities and not spec.shared:
        return group.head(), None
    swaps = {R.IntentValue.load(kv.value).token for n in spec.node_names() if (ns := nodes.get(n))
             for kv in ns.intents.values()}
    h = PR.head_of(group, spec, now_ms, swaps, holders)
    return ((h.job, h.kv) if h else None), h


def plan_group(group: GroupState, nodes: dict[str, NodeState], jobs: dict[str, JobState],
               now_ms: int, policy: Policy = Policy(),
               node_jobs: dict[str, set[str]] | None = None,
               holding: Callable[[str], Iterable[R.GroupSpec]] | None = None) -> list[Action]:
    """``node_jobs`` (node -> jobs with workers there) is an index of ``jobs``; computed if absent.
    ``holding(job)`` gives the specs of the groups a job holds now (its grants): such a job is
    never snapshotted on those groups' devices (it is running there); the head waits instead."""
    spec = group.parsed or (R.GroupSpec.load(group.spec.value) if group.spec else R.GroupSpec())
    live: dict[str, tuple[KV, R.GrantValue]] = {}
    drops: list[Action] = []
    for gkv in group.holders().values():
        g = R.GrantValue.load(gkv.value)
        qkv = group.queue.get(g.job)
        if qkv is None or qkv.create_revision != g.token:
            # The holder yielded or died; its grant must go before anyone else's comes.
            drops.append(DropGrant(gkv.value, g.job, gkv.key))
        else:
            live[g.job] = (gkv, g)
    if drops:
        return drops
    turns = PR.turns_of(group) if spec.priorities or spec.shared else None
    if turns is not None:
        moves = RK.moves(group.queue, group.moving, turns.token, {(j, g.token) for j, (_, g) in live.items()})
        if moves:
            return list(moves)                            # overtaken entries re-key first (lockd.rekey)
    ctx = PlanContext(spec, nodes, jobs, node_jobs, holding, now_ms, policy, turns if spec.priorities else None)
    if spec.shared:
        from timeslice.lockd import fitplan  # it builds on this module: imported once plan is whole
        return fitplan.plan_fit(ctx, group, live, turns or PR.Turns())
    if live:
        return []                                         # the head already holds
    head, prio = pick_head(group, spec, nodes, now_ms)
    if head is None:
        return []                                         # idle
    if prio is not None and turns is not None:
        if not prio.ready:
            return []                                     # overtaken earlier: its Acquire re-keys it first
        if prio.raise_to:
            # Before any intent or grant carries this token: the waiters it overtakes must re-key above it.
            return [RaiseTurns(prio.raise_to, turns.mod_revision, turns.raised(prio.raise_to))]
    return serve(ctx, *head)


@dataclass(frozen=True)
class PlanContext:
    """What one plan of one group looks at, handed to ``serve`` (and to lockd.weights' fit plan)."""

    spec: R.GroupSpec
    nodes: dict[str, NodeState]
    jobs: dict[str, JobState]
    node_jobs: dict[str, set[str]] | None
    holding: Callable[[str], Iterable[R.GroupSpec]] | None
    now_ms: int
    policy: Policy
    count: PR.Turns | None                # a priority group's grant counts itself in the turns key


def _answered(ns: NodeState | None, job: str, ikv: KV) -> bool:
    """The agent has reported the outcome of ``job``'s intent ``ikv`` (its status names that revision)."""
    st = status_of(ns, job)
    return st is not None and st.intent_revision == ikv.mod_revision and bool(st.outcome)


def serve(ctx: PlanContext, head_job: str, head_kv: KV,
          reserve: dict[str, dict[int, int]] | None = None) -> list[Action]:
    """The swap for ``head_job`` (the steps in the module's docstring), node by node: its intents,
    or its grant once every node is settled. ``reserve``: node -> GPU -> bytes kept free for a fit
    group's holders to grow into their footprints (lockd.weights)."""
    spec, nodes, jobs, node_jobs, holding = ctx.spec, ctx.nodes, ctx.jobs, ctx.node_jobs, ctx.holding
    now_ms, policy = ctx.now_ms, ctx.policy
    token, lease = head_kv.create_revision, head_kv.lease
    entry_value = R.QueueValue.load(head_kv.value)
    hint = entry_value.device_bytes_hint

    actions: list[Action | None] = []                   # None: an intent already written as is
    # pending: some node still needs a snapshot or restore (even if its intent is
    # already written); the grant comes only when no node does.
    waiting = pending = restored = elided = False
    moved = 0
    for entry in spec.nodes:
        node = entry["node"]
        ns = nodes.get(node)
        on_node = (node_jobs.get(node, set()) if node_jobs is not None
                   else {j for j, js in jobs.items() if node in js.nodes()})
        agent = R.AgentValue.load(ns.agent.value) if ns is not None and ns.agent is not None else None
        # 0. Intents of this swap on the node: wait for them, time them out, or read their result.
        node_waiting = head_back = False
        refused_restore = None
        for job, ikv in (ns.intents.items() if ns else ()):
            intent = R.IntentValue.load(ikv.value)
            if intent.token != token:
                if job == head_job and not _answered(ns, job, ikv) and (
                        now_ms - intent.issued_ms <= policy.swap_timeout_ms):
                    # An op on the head's own memory from an earlier swap is still running (it was being
                    # parked for a waiter that has gone since: a job killed and started again under its
                    # id): where its memory will be, only that op's answer says. Granting now would hand
                    # the head a device the agent is checkpointing (the fit long fault run saw it).
                    node_waiting = True
                continue
            st = status_of(ns, job)
            if st is None or st.intent_revision != ikv.mod_revision or not st.outcome:
                if now_ms - intent.issued_ms > policy.swap_timeout_ms:
                    return [FailWaiter(head_job, token, lease, node=node, reason=(
                        f"agent on node {node} did not report the {intent.op} of job {job} "
                        f"within {policy.swap_timeout_ms / 1000:.0f}s"))]
                node_waiting = True
                continue
            if job == head_job and intent.op == R.RESTORE and st.outcome == R.REFUSED:
                # No room after all (the agent admits per GPU, with fresher figures):
                # make room or retry, below, before failing the job.
                refused_restore = ikv
                continue
            bad = st.outcome in (R.FAILED, R.REFUSED) or (
                job == head_job and st.outcome == R.PROCESS_GONE)
            if bad:
                return [FailWaiter(head_job, token, lease, node=node, reason=(
                    f"{intent.op} of job {job} on node {node} {st.outcome}: "
                    f"{st.error or 'processes gone'}"))]
            moved += st.bytes
            head_back |= intent.op == R.RESTORE and job == head_job and st.outcome == R.OK
            restored |= intent.op == R.RESTORE and job == head_job
        if node_waiting:
            waiting = True
            continue
        where = {j: residency(ns, j, True, agent) for j in on_node if j != head_job}
        where.update((j, "partial") for j in parked_left(ns, agent, on_node) if j != head_job)
        running = sorted(j for j, w in where.items() if w in RESIDENT)
        b_where = residency(ns, head_job, head_job in on_node, agent)
        if ns is None or agent is None:
            # Nothing can be moved here, and what is on its devices only the agent could say: the jobs
            # registered here, and those whose last status says their memory may be here.
            if running or b_where != "absent" or unreported_memory(ns, head_job):
                return [FailWaiter(head_job, token, lease, node=node,
                                   reason=f"node agent on {node} is not alive")]
            continue
        view = NodeView.of(node, agent)
        if unfenced(agent, node, head_job, jobs, ns):
            # A job the agent still reports running here has no registration any more (its session
            # went): it may still run kernels. Wait until the agent froze it (nodeagent/orphans.py:
            # it then leaves the running jobs) or saw it exit; the Acquire's deadline bounds the wait.
            pending = True
            continue
        if b_where == "unknown" and not head_back:
            # Where the head's memory is, the agent cannot tell now (a cooperative worker of it has not
            # reconnected): never grant before a restore says it is back. The agent answers once the
            # worker is back (asking for room, if it needs some, by refusing), or fails it with the reason.
            actions.append(_because(_intent(ns, node, head_job, R.RESTORE, token),
                                    f"the agent cannot tell where job {head_job}'s memory is on {node} (a worker "
                                    f"not reconnected): its restore answers once it is back, before any grant"))
            pending = True
            continue
        # Residents: other jobs with a device context on some GPU of this node, by GPU.
        residents = {j: g for j in running if (g := view.resident_gpus(j, jobs.get(j)))}
        if b_where == "partial":
            b_where = "snapshotted"            # for itself: a snapshot to restore, like any other
        b_snap = status_of(ns, head_job) if b_where == "snapshotted" else None
        b_gpus = view.known_gpus(head_job, jobs.get(head_job), b_snap) or view.group_gpus(entry)
        need = need_per_gpu(view, head_job, b_where, b_snap, b_gpus, hint, entry_value.peak_bytes,
                            entry_value.context_bytes, policy.footprint)
        # GPUs where room must be made: all of B's (unknown need), or where B does not fit.
        free: dict[int, int] = {}
        if need is None:
            short = set(b_gpus) if policy.evict_unknown else set()
        else:
            # A partly paused resident's released bytes are off the device: not "registered, uncounted".
            off = {j: st.device_bytes for j in residents if where[j] == "partial" and (st := status_of(ns, j))}
            free = view.free_after_registered(residents, jobs, off)
            for gpu, kept_b in (reserve or {}).get(node, {}).items():
                free[gpu] = free.get(gpu, 0) - kept_b  # a fit group's holders may grow to their footprints
            short = {g for g, n in need.items() if n > 0 and n > free.get(g, 0) - policy.device_margin_bytes}
        if refused_restore is not None:
            short |= set(b_gpus)       # the agent saw less room than we did: make room on all of B's GPUs
        evict = sorted(j for j, g in residents.items() if g & short)
        kept = {j for j in evict if is_protected(j, node, residents[j], view, holding)}
        if kept:
            # A job that holds a group on these devices is running there: never park it. Evict
            # the others if that alone makes room; else the head waits until the holder yields
            # (its Acquire deadline bounds the wait).
            evict = [j for j in evict if j not in kept]
            # A first hold's spare moves what may be moved; it never makes the head wait on a holder.
            floor = need if need is None else need_per_gpu(
                view, head_job, b_where, b_snap, b_gpus, hint, entry_value.peak_bytes, entry_value.context_bytes,
                dataclasses.replace(policy.footprint, first_hold_spare=0.0))
            if floor is None or refused_restore is not None or any(
                    floor.get(g, 0) > free.get(g, 0) - policy.device_margin_bytes
                    + sum((view.seen(j) or {}).get(g, 0) for j in evict) for g in short):
                pending = True
                continue
        if not evict and (short if refused_restore is None else not _evicted_since(ns, token, refused_restore)):
            # Nobody resident to pause, and still no room: what parked cooperative jobs left on the
            # device outside their regions (their residue: CUDA context, allocator blocks) is in the
            # way. It goes by the checkpoint full isolation uses, for this swap only, rather than
            # the head being granted without room for its footprint (lockd.footprints: the agent's
            # restore admission sees only the snapshot, not the phase's peak) or its restore refused
            # until the swap timeout. A head whose snapshot fits already is restored at once, beside
            # the residue's checkpoint (two processes' ops run in parallel); the grant waits for both.
            # After a refused restore, the residents go first; a residue only when nothing was
            # evicted since.
            rest = residue_holders(view, ns, where, jobs, short or set(b_gpus), spec.isolation)
            if rest:
                why = room_text(head_job, node, need, free, short or set(b_gpus), policy.device_margin_bytes)
                actions += [_because(_intent(ns, node, j, R.SNAPSHOT, token, 0, R.ISOLATION_FULL),
                                     f"{why}; nobody resident is left to pause: job {j}'s residue (what its "
                                     f"pause left on the device) is checkpointed for this swap") for j in rest]
                if (b_where == "snapshotted" and refused_restore is None
                        and _restore_fits(view, b_snap, b_gpus, free, policy.device_margin_bytes)):
                    actions.append(_because(_intent(ns, node, head_job, R.RESTORE, token),
                                            f"job {head_job}'s snapshot fits beside the rest: its restore need not "
                                            f"wait for the residue's checkpoint"))
                pending = True
                continue
        # How much each must free: a cooperative worker then releases only that much
        # (discard regions first); 0 = everything (unknown need, or a refused restore).
        room = {j: 0 if need is None or refused_restore is not None else
                sum(max(0, need[g] - (free.get(g, 0) - policy.device_margin_bytes)) for g in short & residents[j])
                for j in evict}
        why = ("the agent refused its restore for room" if refused_restore is not None else
               room_text(head_job, node, need, free, short, policy.device_margin_bytes))
        asks = [_because(a, f"{why}; job {j} is resident there: "
                            f"{'release ' + size_text(room[j]) if room[j] else 'release all of it'}")
                for j in evict if not isinstance(
                    a := _snapshot(ns, node, j, token, room[j], may_checkpoint_rest(view, jobs.get(j), spec.isolation)),
                    _Done)]
        if refused_restore is not None:
            step = _after_refused_restore(ns, node, head_job, head_kv, token, asks, refused_restore,
                                          now_ms, policy)
            if isinstance(step, FailWaiter):
                return [step]
            actions += step or []
            pending = True
            continue
        if evict:
            if asks:
                actions += asks
                pending = True
                continue
            # Everything this swap can take from them is taken, and by our figures the head is still
            # short (what they keep outside their regions, figures not refreshed yet). A head to
            # restore asks the agent, which admits on exact figures (a refusal is retried, then fails
            # the head with the agent's reason); any other head waits, within the swap timeout.
            if b_where != "snapshotted":
                if now_ms - R.QueueValue.load(head_kv.value).enqueued_ms >= policy.swap_timeout_ms:
                    return [FailWaiter(head_job, token, lease, node=node, reason=(
                        f"no room for job {head_job} on node {node}: jobs {', '.join(evict)} were paused "
                        f"for it and the devices are still short"))]
                pending = True
                continue
        freeze = S.to_freeze(spec.isolation, ns, node, view.group_gpus(entry), residents, token, view, holding)
        if freeze:
            # Strict: those left beside B run nothing until they acquire again; B waits for the agent.
            actions += [_because(_intent(ns, node, j, R.FREEZE, token),
                                 f"strict group: job {j} stays resident beside job {head_job} on {node} (it fits); "
                                 f"frozen until its own next grant") for j in freeze]
            pending = True
        elided |= any(g & set(b_gpus) for g in residents.values())
        if b_where == "snapshotted":
            actions.append(_because(_intent(ns, node, head_job, R.RESTORE, token),
                                    f"job {head_job} is parked on {node}: " + (
                                        room_text(head_job, node, need, free, set(b_gpus),
                                                   policy.device_margin_bytes) if need else "its memory back")))
            pending = True
        elif S.is_frozen(ns, head_job):
            # At once, beside the freezes: nobody holds the group until the grant, which waits for both.
            actions.append(_because(_intent(ns, node, head_job, R.THAW, token),
                                    f"job {head_job} was frozen on {node} by an earlier strict handoff"))
            pending = True
    if waiting or pending:
        return [a for a in actions if a is not None]
    if ctx.count is not None:
        return [WriteGrant(head_job, token, lease, restored, elided, moved, ctx.count.mod_revision,
                           ctx.count.counted())]
    return [WriteGrant(head_job, token, lease, restored, elided, moved)]


def _after_refused_restore(ns: NodeState, node: str, head_job: str, head_kv, token: int,
                           asks: list[WriteIntent | None], refused, now_ms: int,
                           policy: Policy) -> list[Action] | FailWaiter | None:
    """The agent refused the head's restore for lack of room (it admits per GPU, on fresher
    figures than ours). Make room by evicting the residents of the head's GPUs (``asks``: what
    is still to take from them); else retry every ``refused_retry_ms`` (memory held by an
    exiting process comes back) until the waiter has waited ``swap_timeout_ms``; then fail it
    with the agent's reason. None = wait."""
    if asks:
        return [a for a in asks if a is not None]
    st = status_of(ns, head_job)
    retry = WriteIntent(node, head_job, R.RESTORE, token, refused.mod_revision,
                        reason=f"the agent refused job {head_job}'s restore on {node} for room: retried")
    if _evicted_since(ns, token, refused):
        return [retry]
    if now_ms - R.QueueValue.load(head_kv.value).enqueued_ms < policy.swap_timeout_ms:
        return [retry] if st is None or now_ms - st.updated_ms >= policy.refused_retry_ms else None
    return FailWaiter(head_job, token, head_kv.lease, node=node, reason=(
        f"restore of job {head_job} on node {node} refused: {st.error if st else 'no room'}"))


def _because(a, reason: str):
    """``a`` with its reason, if it is an intent to write (None: already issued; _DONE: nothing to take)."""
    return replace(a, reason=reason) if isinstance(a, WriteIntent) else a


def _restore_fits(view: NodeView, snap: R.StatusValue | None, gpus: frozenset[int], free: dict[int, int],
                  margin: int) -> bool:
    """The head's snapshot alone fits in what is free on each of its GPUs now (with the agent's
    restore headroom): its restore need not wait for the residue's checkpoint."""
    if snap is None:
        return False
    per = view.by_index(snap.gpu_bytes) if snap.gpu_bytes else None
    if per is None:
        per = {g: snap.device_bytes for g in gpus}
    return all(n + RESTORE_HEADROOM_BYTES <= free.get(g, 0) - margin for g, n in per.items() if n > 0)


def _evicted_since(ns: NodeState, token: int, refused) -> bool:
    """A snapshot of this swap was written after the head's restore was refused (retry the restore)."""
    return any(kv.mod_revision > refused.mod_revision and (i := R.IntentValue.load(kv.value)).op == R.SNAPSHOT
               and i.token == token for kv in ns.intents.values())


class _Done:
    """_snapshot's answer: nothing more this swap can take from the job."""


_DONE = _Done()


def _snapshot(ns: NodeState | None, node: str, job: str, token: int, need_bytes: int,
              may_checkpoint_rest: bool) -> WriteIntent | _Done | None:
    """The snapshot intent that makes ``job`` free (more) room for this swap's head.

    A job this swap paused already (its snapshot intent of this token answered ok) that is still
    in the way is asked for more, one step at a time: the rest of its regions (need 0) after a
    selective pause; then, where allowed, the checkpoint of what it keeps outside them (its
    residue, ``R.ISOLATION_FULL``). Past that ``_DONE``. Without this the planner saw its own
    intent "already issued" and waited for a report that was in: nothing written, no grant, ever."""
    kv = ns.intents.get(job) if ns else None
    cur = R.IntentValue.load(kv.value) if kv is not None else None
    st = status_of(ns, job)
    if (kv is None or cur is None or cur.op != R.SNAPSHOT or cur.token != token or st is None
            or st.intent_revision != kv.mod_revision or st.outcome != R.OK):
        return _intent(ns, node, job, R.SNAPSHOT, token, need_bytes)
    if st.state != R.SNAPSHOTTED:
        return None        # answered ok, yet not parked (a stale read): wait for the agent's next word
    if cur.need_bytes > 0:
        return WriteIntent(node, job, R.SNAPSHOT, token, kv.mod_revision, 0)
    if may_checkpoint_rest and not R.checkpoints_rest(cur.isolation):
        return WriteIntent(node, job, R.SNAPSHOT, token, kv.mod_revision, 0, R.ISOLATION_FULL)
    return _DONE


def _intent(ns: NodeState | None, node: str, job: str, op: str, token: int,
            need_bytes: int = 0, isolation: str = "") -> WriteIntent | None:
    kv = ns.intents.get(job) if ns else None
    if kv is not None:
        cur = R.IntentValue.load(kv.value)
        if cur.op == op and cur.token == token and (not isolation or cur.isolation == isolation):
            return None                                   # already issued: wait for its report
    return WriteIntent(node, job, op, token, kv.mod_revision if kv else 0, need_bytes, isolation)
