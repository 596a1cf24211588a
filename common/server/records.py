"""The JSON values stored under each key (see keys.py), shared by every component.

One dataclass per kind of value; ``dump()`` gives compact, sorted JSON and
``load()`` ignores unknown fields, so a newer writer never breaks an older
reader during a rolling upgrade.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Record")

# Where a job's context is on a node (status.state), written by the agent.
RUNNING = "running"            # on the device (restored, or never moved)
SNAPSHOTTING = "snapshotting"  # an op is in progress
SNAPSHOTTED = "snapshotted"    # in host memory; the process is alive and paused
RESTORING = "restoring"
GONE = "gone"                  # the job's processes no longer exist
LOST = "lost"                  # a restore failed in a way the driver cannot undo
FROZEN = "frozen"              # on the device, every process locked: it runs nothing (strict groups, orphans)
# The agent cannot tell where the job's memory is: a cooperative worker with no open channel to it
# (not reconnected after an agent restart, past --reconnect-grace-s). Planned as resident; never granted
# before the agent has seen its memory back.
UNKNOWN = "unknown"
TERMINAL = frozenset({RUNNING, SNAPSHOTTED, GONE, LOST, FROZEN, UNKNOWN})

# How the op an intent asked for ended (status.outcome); "" while in progress.
OK = "ok"
FAILED = "failed"              # tried and failed; error says why; state says where the context is
REFUSED = "refused"            # not attempted (stale token, no room): nothing changed
PROCESS_GONE = "gone"          # nothing to do: the processes are gone (not an error of the group)

SNAPSHOT = "snapshot"
RESTORE = "restore"
FREEZE = "freeze"              # lock the job's processes in place (strict groups: an elided handoff)
THAW = "thaw"                  # unlock them again (the frozen job acquires again)
OPS = frozenset({SNAPSHOT, RESTORE, FREEZE, THAW})

# How the agent moves a worker's memory (WorkerValue.swap; see lockd.proto WorkerRequest.swap).
SWAP_CHECKPOINT = "checkpoint"
SWAP_COOPERATIVE = "cooperative"
SWAP_VLLM = "vllm"
SWAP_SGLANG = "sglang"
SWAP_KINDS = frozenset({SWAP_CHECKPOINT, SWAP_COOPERATIVE, SWAP_VLLM, SWAP_SGLANG})
TAG_OFFLOAD = "offload"        # kept in host memory, restored bit-exact
TAG_DISCARD = "discard"        # released on pause, recreated empty on resume
TAG_POLICIES = frozenset({TAG_OFFLOAD, TAG_DISCARD})
ISOLATION_NONE = ""            # a parked cooperative worker keeps its (small) CUDA context on the device
ISOLATION_FULL = "full"        # after the cooperative pause, the CUDA checkpoint takes what is left
# Everything "full" does, and on an elided handoff (the next job fits beside the yielded one) the
# yielded jobs' processes on the group's GPUs are frozen (process lock) before the grant, and
# thawed when their job acquires again. A ladder, one field: "" < "full" < "strict".
ISOLATION_STRICT = "strict"
ISOLATIONS = frozenset({ISOLATION_NONE, ISOLATION_FULL, ISOLATION_STRICT})
# A group's sharing policy (GroupSpec.sharing; lockd/weights.py). "exclusive": one holder at a time, the
# lock as it always was (its grant is ``groups/<g>/grant``). "fit": a FIFO weighted semaphore per GPU, each
# grant weighing its admitted footprint; a job whose footprint is unknown, or that asks for the GPUs alone,
# weighs the whole device (its grants are ``groups/<g>/grants/<job>``, one per holder).
SHARING_EXCLUSIVE = "exclusive"
SHARING_FIT = "fit"
SHARINGS = frozenset({SHARING_EXCLUSIVE, SHARING_FIT})


def checkpoints_rest(isolation: str) -> bool:
    """True if a cooperative pause is followed by the CUDA checkpoint of what is left."""
    return isolation in (ISOLATION_FULL, ISOLATION_STRICT)


def freezes_elided(isolation: str) -> bool:
    """True if the jobs left resident by an elided handoff are frozen before the grant."""
    return isolation == ISOLATION_STRICT


def now_ms() -> int:
    return int(time.time() * 1000)


_FIELDS: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return names


class Record:
    """Base of the stored values; every subclass is a dataclass."""

    #: Fields left out of ``dump()`` while they hold their default: an opt-in feature's fields
    #: (priority classes) leave the values of everyone who does not use it byte for byte as before.
    _omit_default: ClassVar[frozenset[str]] = frozenset()

    def dump(self) -> bytes:
        data = dataclasses.asdict(self)  # type: ignore[call-overload]  # subclasses are dataclasses
        if self._omit_default:
            for f in dataclasses.fields(self):  # type: ignore[arg-type]
                default = f.default_factory() if f.default is dataclasses.MISSING \
                    and f.default_factory is not dataclasses.MISSING else f.default
                if f.name in self._omit_default and data[f.name] == default:
                    del data[f.name]
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def load(cls: type[T], raw: bytes | str) -> T:
        data: dict[str, Any] = json.loads(raw)
        names = _field_names(cls)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class GroupSpec(Record):
    nodes: list[dict] = field(default_factory=list)   # [{"node": str, "gpus": [int]}]
    created_ms: int = 0
    isolation: str = ISOLATION_NONE
    tenants: list[str] = field(default_factory=list)  # who may acquire it ("*": every tenant); lockd/tenancy.py
    admins: list[str] = field(default_factory=list)   # tenants that administer it (delete it, see all its jobs)
    # Priority classes (lockd/priority.py): off = pure FIFO. On: the head is the earliest waiter of the
    # highest class, and a waiter is served first, in arrival order, once ``max_overtakes`` grants were
    # made since it joined or it waited ``max_wait_ms`` (0: no time bound).
    priorities: bool = False
    max_overtakes: int = 0
    max_wait_ms: int = 0
    sharing: str = SHARING_EXCLUSIVE                  # SHARINGS; a spec stored without it is exclusive
    _omit_default = frozenset({"priorities", "max_overtakes", "max_wait_ms", "sharing"})

    def node_names(self) -> list[str]:
        return [n["node"] for n in self.nodes]

    @property
    def shared(self) -> bool:
        """True for a ``fit`` group: several holders at once, one grant key each."""
        return self.sharing == SHARING_FIT


@dataclass
class RevokedValue(Record):
    """A group deleted under a queued job (see Keys.revoked)."""

    group: str
    token: int
    deleted_ms: int = 0
    held: bool = False                # the job was the group's head (it held or was about to)


@dataclass
class QueueValue(Record):
    job: str
    session: int = 0                  # lease id, hex in logs
    device_bytes_hint: int = 0
    enqueued_ms: int = 0
    replica: str = ""
    attempt: str = ""                 # the Acquire call that owns the entry now (see lockd/locks.py)
    trace: str = ""                   # W3C traceparent of that Acquire (common/tracing.py); "" when off
    last_hold_ms: int = 0             # the job's own measure of its previous hold of the group (lockd/profiles.py)
    # Priority groups only (lockd/priority.py); left out of the stored JSON while 0:
    priority: int = 0                 # the class asked for: 0 (default, lowest) .. MAX_PRIORITY
    since: int = 0                    # create revision of the job's first entry (0: this entry's): arrival
    since_grants: int = 0             # the group's grant count when the job joined (aging)
    # The job's own measures of its earlier holds of the group, per node (lockd/footprints.py); left
    # out of the stored JSON while 0 (a client that does not measure):
    peak_bytes: int = 0               # the largest allocator peak of a hold (torch: max_memory_reserved)
    context_bytes: int = 0            # its memory outside the allocator (NVML's figure less the reservation)
    exclusive: bool = False           # the phase asks for the GPUs alone (fit groups; left out while False)
    _omit_default = frozenset({"priority", "since", "since_grants", "peak_bytes", "context_bytes", "exclusive"})

    def arrival(self, create_revision: int) -> int:
        """The job's place in arrival order: kept when its entry is written again under a fresh key."""
        return self.since or create_revision


@dataclass
class TurnsValue(Record):
    """``groups/<g>/turns`` of a priority group, written by the leader (lockd/priority.py)."""

    token: int = 0                    # highest token granted ahead of an earlier waiter: entries below re-key
    grants: int = 0                   # grants made on the group (a waiter ages by the grants since it joined)
    updated_ms: int = 0


@dataclass
class GrantValue(Record):
    job: str
    token: int
    leader_epoch: int
    restored: bool = False
    elided: bool = False
    bytes_moved: int = 0
    granted_ms: int = 0
    # Fit groups only (lockd/weights.py); left out of the stored JSON while at their defaults, so an
    # exclusive group's grant is byte for byte what it always was:
    footprint: dict = field(default_factory=dict)   # "<node>/<GPU index>" -> admitted bytes there
    exclusive: bool = False           # weighs the whole device: alone on its GPUs (asked, or footprint unknown)
    backfilled: bool = False          # granted before an earlier waiter that did not fit (never delays it)
    _omit_default = frozenset({"footprint", "exclusive", "backfilled"})


@dataclass
class FailureValue(Record):
    token: int
    reason: str
    node: str = ""
    failed_ms: int = 0


@dataclass
class SessionValue(Record):
    lease: int
    secret_sha256: str
    opened_ms: int = 0
    replica: str = ""
    peer: str = ""                    # who opened it (lockd.callers): counted against --max-sessions-per-peer
    slot: int = -1                    # its slot of --max-sessions (lockd/slots.py); -1: none (older lockd)
    peer_slot: int = -1               # its slot of --max-sessions-per-peer among the peer's
    tenant: str = ""                  # the tenant its opener's credential named (lockd/tenancy.py; "*": the admin)


@dataclass
class SlotValue(Record):
    """Who holds a slot of a count limit (``slots/<space>/<n>``, lockd/slots.py): for etcdctl readers."""

    job: str
    node: str = ""                    # a worker's slot: its node and pid
    pid: int = 0


@dataclass
class WorkerValue(Record):
    pid: int
    node: str
    device_bytes: int = 0
    registered_ms: int = 0
    swap: str = SWAP_CHECKPOINT
    gpus: list[int] = field(default_factory=list)     # GPU indexes on the node; [] = unknown
    endpoint: str = ""                                 # vllm/sglang base URL
    tags: dict = field(default_factory=dict)           # tag -> offload|discard (cooperative, sglang)
    collective: bool = False                           # CUDA IPC / NCCL p2p: never checkpoint
    slot: int = -1                                     # its slot of the job's max_workers_per_job; -1: none


@dataclass
class AttestedValue(Record):
    """A process proved to its node's agent, over the node-local channel, that it is ``job``'s.

    Written by the agent before it welcomes the worker, on the agent's lease; lockd
    refuses another job's registration of the pid (lockd/ownership.py).
    """

    job: str
    pid: int
    start_time: int | None = None       # the process incarnation (pids are reused)
    attested_ms: int = 0


@dataclass
class ProtectedValue(Record):
    """Processes of a node that no job may register: init, the agent, etcd, lockd (nodeagent/protected.py)."""

    pids: dict = field(default_factory=dict)   # str(pid) -> why it is protected
    updated_ms: int = 0


@dataclass
class AgentValue(Record):
    node: str
    backend: str
    version: str = ""
    gpus: list[dict] = field(default_factory=list)   # [{index, uuid, total_bytes, free_bytes}]
    device_total_bytes: int = 0
    device_free_bytes: int = 0
    host_free_bytes: int = 0
    # job -> bytes on this node's devices, for every job with memory there: running or frozen, paused
    # in part (a cooperative worker that released some regions and keeps others), or of unknown state
    job_device_bytes: dict = field(default_factory=dict)
    updated_ms: int = 0
    endpoint: str = ""
    # job -> {device id (gpus[].uuid): bytes} for every running job the agent has looked at, and the
    # jobs above with memory left on a device: where each has a device context ({} = none: CPU-only,
    # or registered before CUDA init).
    job_gpus: dict = field(default_factory=dict)
    # Jobs with a process whose memory state the agent cannot read now (a cooperative worker with no
    # open channel to it: e.g. not reconnected yet after an agent restart).
    job_unknown: list = field(default_factory=list)


@dataclass
class IntentValue(Record):
    op: str                      # snapshot | restore
    job: str
    group: str
    token: int                   # the fencing token of the grant this swap serves
    leader_epoch: int
    issued_ms: int = 0
    isolation: str = ISOLATION_NONE   # the group's policy (cooperative workers: also checkpoint the rest)
    need_bytes: int = 0          # snapshot: device bytes the incoming job needs on this node (0: release all)


@dataclass
class StatusValue(Record):
    state: str
    job: str
    op: str = ""
    outcome: str = ""
    group: str = ""
    intent_revision: int = 0     # mod_revision of the intent this answers (0: agent's own report)
    token: int = 0
    bytes: int = 0               # bytes moved by the op
    device_bytes: int = 0        # the job's footprint on this node's devices (snapshot size)
    elapsed_ms: float = 0.0
    error: str = ""
    pids: list[int] = field(default_factory=list)
    updated_ms: int = 0
    gpu_bytes: dict = field(default_factory=dict)  # device id -> footprint there (snapshot's while snapshotted)
    residue_bytes: int = 0       # snapshotted cooperatively: what the job still holds on the devices here


@dataclass
class HoldRecord(Record):
    """One finished hold of a group, as the leader saw it (lockd/history.py; read by `timeslice report`)."""

    group: str
    job: str
    token: int
    leader_epoch: int = 0
    enqueued_ms: int = 0          # the queue entry's: the wait is granted_ms - enqueued_ms
    granted_ms: int = 0
    released_ms: int = 0          # yield, handoff, session loss or deletion, as the leader saw it
    restored: bool = False
    elided: bool = False
    bytes_moved: int = 0
    hint_bytes: int = 0           # the queue entry's device_bytes_hint
    prev_busy_ms: int = 0         # the job's own measure of its previous hold of the group (last_hold_ms)
    peak_bytes: int = 0           # the queue entry's peak_bytes: the largest allocator peak of its earlier holds
    context_bytes: int = 0        # the queue entry's context_bytes: its memory outside the allocator
    gpu_bytes: dict = field(default_factory=dict)   # "<node>/<device id>" -> the job's bytes there at release
    # The agents' answers to this grant's swap intents:
    # [{"node", "job", "op", "bytes", "elapsed_ms", "gpu_bytes", "done_ms", "residue_bytes"}]
    swaps: list[dict] = field(default_factory=list)
    # A fit group's grant (GrantValue's): what it was admitted with; left out while at the defaults.
    footprint: dict = field(default_factory=dict)
    exclusive: bool = False
    backfilled: bool = False
    _omit_default = frozenset({"footprint", "exclusive", "backfilled"})
