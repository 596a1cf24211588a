"""What to do with an intent, sans-IO: intent, status and picture in, decision and status out.

The leader writes ``nodes/<node>/intents/<job>`` = {op, job, group, token,
leader_epoch}; the agent answers in ``nodes/<node>/status/<job>`` with the
intent's mod revision. An intent is answered when
``status.intent_revision == intent.mod_revision and status.outcome != ""``;
until then the leader waits (and the agent, restarted, runs it again).

Per intent, in this order:
  1. unreadable intent, or a token older than one already acted on for the
     group → refused, nothing touched;
  2. no live process of the job on this node → gone (not an error);
  3. already in the target state (snapshotted for a snapshot, running for a
     restore, frozen for a freeze, unlocked for a thaw) → ok, nothing redone;
  4. a cooperative worker of the job that has no channel to this agent and did
     not come back within the grace (``nodeagent.reconnects``) → failed, with
     the reason, nothing touched (its memory can be neither moved nor seen back);
  5. a snapshot the job's backend may not take (``checkpoint_refusal``: a
     collective worker swapped by the driver checkpoint) → refused, nothing touched;
  6. otherwise run the backend op.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.nodeagent.backends.ops import JobResult, Outcome
from timeslice.nodeagent.picture import Picture

RUN, REPORT, REFUSE = "run", "report", "refuse"
# The status state while an op runs. A freeze or thaw moves nothing: the state says where the job
# is until it is done (running until frozen, frozen until thawed); the op field says what is asked.
IN_PROGRESS = {R.SNAPSHOT: R.SNAPSHOTTING, R.RESTORE: R.RESTORING, R.FREEZE: R.RUNNING, R.THAW: R.FROZEN}


@dataclass(frozen=True)
class Intent:
    job: str
    revision: int                      # the intent key's mod_revision
    value: R.IntentValue | None
    error: str = ""                    # why the value could not be used

    @classmethod
    def from_kv(cls, job: str, kv: rpc.KeyValue) -> Intent:
        try:
            v = R.IntentValue.load(kv.value)
        except Exception as e:  # whatever is in the key, the answer is a refusal
            return cls(job, kv.mod_revision, None, f"unreadable intent: {e}")
        if v.op not in IN_PROGRESS:
            return cls(job, kv.mod_revision, v, f"unknown op {str(v.op)[:32]!r}; expected one of {sorted(R.OPS)}")
        if not isinstance(v.token, int) or v.token <= 0:
            return cls(job, kv.mod_revision, v, f"intent token {v.token!r} is not a positive integer")
        return cls(job, kv.mod_revision, v)

    @property
    def op(self) -> str:
        return self.value.op if self.value else ""

    @property
    def group(self) -> str:
        return self.value.group if self.value else ""

    @property
    def token(self) -> int:
        return self.value.token if self.value and isinstance(self.value.token, int) else 0

    def log_ctx(self) -> dict:
        return {"job": self.job, "op": self.op, "group": self.group, "token": self.token,
                "intent_revision": self.revision,
                "epoch": self.value.leader_epoch if self.value else 0}


def frozen_by_intent(status: R.StatusValue | None) -> bool:
    """True if the job's status says a freeze intent froze it (and nothing has thawed it since)."""
    return status is not None and status.op == R.FREEZE and status.outcome == R.OK and status.state == R.FROZEN


def answered(intent: Intent, status: R.StatusValue | None) -> bool:
    return status is not None and status.intent_revision == intent.revision and status.outcome != ""


@dataclass(frozen=True)
class IntentDecision:
    kind: str                          # run | report | refuse
    outcome: str = ""                  # for report / refuse
    reason: str = ""
    fence: int = 0                     # a stale-token refusal: the token that fences it out


# NCCL settings under which a collective job's contexts survive a driver checkpoint (README).
NCCL_CHECKPOINT_SAFE = "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0"


def checkpoint_refusal(workers: Iterable[R.WorkerValue]) -> str:
    """Why the driver checkpoint must not touch this job ("" if it may).

    A worker registered ``collective=True`` uses CUDA IPC / NCCL peer-to-peer. Measured on
    2×H200 (driver 580): the checkpoint of such processes succeeds, the restore fails (801,
    or 1 with NCCL_CUMEM_ENABLE=0) and the job is lost. So unless it is swapped cooperatively
    (``swap`` cooperative / vllm / sglang: the communicator stays alive), it is refused before
    anything is touched.
    """
    bad = sorted(w.pid for w in workers if w.collective and (w.swap or R.SWAP_CHECKPOINT) == R.SWAP_CHECKPOINT)
    if not bad:
        return ""
    shown = ", ".join(map(str, bad[:8])) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    return (f"snapshot refused: pid(s) {shown} registered collective=True (CUDA IPC / NCCL peer-to-peer) "
            f"with swap=checkpoint; a driver restore of such a context fails and loses the job. Register "
            f"them with swap=cooperative (or vllm/sglang), or run NCCL with {NCCL_CHECKPOINT_SAFE} and "
            f"register collective=False")


def decide(intent: Intent, picture: Picture, stale_reason: str = "", fence: int = 0,
           refusal: str = "", away: str = "") -> IntentDecision:
    """``refusal``: why the backend may not snapshot this job (``checkpoint_refusal``); ``away``:
    why some of its cooperative workers cannot be reached (``Reconnects.wait_all``)."""
    if intent.error:
        return IntentDecision(REFUSE, R.REFUSED, intent.error)
    if stale_reason:
        return IntentDecision(REFUSE, R.REFUSED, stale_reason, fence)
    if picture.state == R.GONE:
        return IntentDecision(REPORT, R.PROCESS_GONE, "no live process of the job on this node")
    # A snapshot asking for full isolation has work on a job paused cooperatively with memory left
    # outside its regions (its residue): the checkpoint of the rest (the planner asks for it when
    # that residue is in the next job's way).
    rest = (intent.op == R.SNAPSHOT and intent.value is not None and R.checkpoints_rest(intent.value.isolation)
            and picture.state == R.SNAPSHOTTED and picture.residue_bytes > 0)
    if not picture.needs(intent.op) and not rest:
        return IntentDecision(REPORT, R.OK, f"nothing to {intent.op}: the job is {picture.state} already")
    if away:
        return IntentDecision(REPORT, R.FAILED, away)
    if refusal and intent.op == R.SNAPSHOT:
        return IntentDecision(REFUSE, R.REFUSED, refusal)
    return IntentDecision(RUN)


def status(intent: Intent, state: str, outcome: str, *, bytes_moved: int = 0, device_bytes: int = 0,
           elapsed_ms: float = 0.0, error: str = "", pids: Iterable[int] = (), token: int = 0,
           gpu_bytes: dict[str, int] | None = None, residue_bytes: int = 0) -> R.StatusValue:
    """The status answering ``intent`` (outcome "" = still in progress).

    ``token`` is the intent's, except in a stale-token refusal: there it is the
    newer token that fences the intent out, so the status the refusal replaces
    does not take the agent's only durable record of that token with it
    (``TokenBook.recover`` reads it back after a restart).
    """
    return R.StatusValue(
        state=state, job=intent.job, op=intent.op, outcome=outcome, group=intent.group,
        intent_revision=intent.revision, token=token or intent.token, bytes=bytes_moved,
        device_bytes=device_bytes, elapsed_ms=round(elapsed_ms, 3), error=error,
        pids=sorted(pids), updated_ms=R.now_ms(), gpu_bytes=dict(gpu_bytes or {}), residue_bytes=residue_bytes)


def in_progress(intent: Intent, picture: Picture) -> R.StatusValue:
    return status(intent, IN_PROGRESS[intent.op], "", device_bytes=picture.device_bytes,
                  pids=picture.live_pids, gpu_bytes=picture.gpu_bytes)


def moved_before(intent: Intent, old: R.StatusValue | None) -> int:
    """Bytes an earlier snapshot of the same swap (token, group) moved for this job, which a further
    snapshot of it (the full-isolation checkpoint of a residue) adds to, so the grant counts both:
    the leader reads one status per job."""
    if (old is None or intent.value is None or intent.op != R.SNAPSHOT or old.op != R.SNAPSHOT
            or old.outcome != R.OK or old.token != intent.token or old.group != intent.group):
        return 0
    return old.bytes


def outcome_of(result: JobResult) -> str:
    if result.refused:
        return R.REFUSED
    if result.all_gone:
        return R.PROCESS_GONE
    return R.OK if result.ok else R.FAILED


def moved_bytes(*results: JobResult | None) -> int:
    """Bytes actually copied (a process already in the target state moved nothing)."""
    return sum(r.bytes for res in results if res is not None for r in res.results
               if r.outcome is Outcome.DONE)


def final(intent: Intent, result: JobResult, after: Picture, elapsed_ms: float,
          rollback: JobResult | None = None) -> R.StatusValue:
    """The status that answers ``intent`` once its op ran; the state is read, not assumed."""
    error = result.error
    if rollback is not None:
        error += ("; the processes already checkpointed were restored (the job is left running)"
                  if rollback.ok else f"; restoring the processes already checkpointed failed too: "
                  f"{rollback.error}")
    return status(intent, after.state, outcome_of(result), bytes_moved=moved_bytes(result, rollback),
                  device_bytes=after.device_bytes, elapsed_ms=elapsed_ms, error=error,
                  pids=after.live_pids, gpu_bytes=after.gpu_bytes, residue_bytes=after.residue_bytes)


def corrected(old: R.StatusValue, after: Picture) -> R.StatusValue | None:
    """``old`` with its state and figures brought in line with reality, or None if they already are.

    Keeps the answer to the intent (revision, outcome, token) as it was: only
    where the context is changes (a process died, a direct API call moved it).
    """
    if old.outcome == "":
        return None                    # an op in progress: its driver writes the status
    if any(str(st) == "unknown" for st in after.states.values()):
        # A process the backend cannot read now (a cooperative worker whose channel is not back
        # yet after an agent restart): keep the last known truth rather than guess "running".
        return None
    # A running job's size moves with its allocator; the leader reads it from the
    # agent key. Only a snapshot's size, which a restore needs, is kept exact here.
    if old.state == after.state and sorted(old.pids) == after.live_pids and \
            (after.state != R.SNAPSHOTTED or (old.device_bytes, old.gpu_bytes) == (after.device_bytes,
                                                                                  after.gpu_bytes)):
        return None
    return R.StatusValue(**{**old.__dict__, "state": after.state, "device_bytes": after.device_bytes,
                            "pids": after.live_pids, "updated_ms": R.now_ms(), "gpu_bytes": after.gpu_bytes,
                            "residue_bytes": after.residue_bytes})
