from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("job_id", "ttl_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ttl_seconds: int
    def __init__(self, job_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("job_id", "session_secret", "lease_id", "ttl_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_secret: str
    lease_id: int
    ttl_seconds: int
    def __init__(self, job_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., lease_id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("job_id", "session_secret", "lost")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_secret: str
    lost: bool
    def __init__(self, job_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., lost: _Optional[bool] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("ttl_seconds", "revoked_groups")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    revoked_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ttl_seconds: _Optional[int] = ..., revoked_groups: _Optional[_Iterable[str]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("job_id", "session_secret", "group_id", "device_bytes_hint", "attempt_seq", "last_hold_ms", "priority", "peak_bytes", "context_bytes", "exclusive")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_HINT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_secret: str
    group_id: str
    device_bytes_hint: int
    attempt_seq: int
    last_hold_ms: int
    priority: int
    peak_bytes: int
    context_bytes: int
    exclusive: bool
    def __init__(self, job_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., group_id: _Optional[str] = ..., device_bytes_hint: _Optional[int] = ..., attempt_seq: _Optional[int] = ..., last_hold_ms: _Optional[int] = ..., priority: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., context_bytes: _Optional[int] = ..., exclusive: _Optional[bool] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("group_id", "job_id", "token", "leader_epoch", "waited_ms", "restored", "elided", "bytes_moved", "footprint_bytes", "exclusive", "backfilled")
    class FootprintBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    BACKFILLED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    job_id: str
    token: int
    leader_epoch: int
    waited_ms: float
    restored: bool
    elided: bool
    bytes_moved: int
    footprint_bytes: _containers.ScalarMap[str, int]
    exclusive: bool
    backfilled: bool
    def __init__(self, group_id: _Optional[str] = ..., job_id: _Optional[str] = ..., token: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., waited_ms: _Optional[float] = ..., restored: _Optional[bool] = ..., elided: _Optional[bool] = ..., bytes_moved: _Optional[int] = ..., footprint_bytes: _Optional[_Mapping[str, int]] = ..., exclusive: _Optional[bool] = ..., backfilled: _Optional[bool] = ...) -> None: ...

class YieldRequest(_message.Message):
    __slots__ = ("job_id", "session_secret", "group_id", "token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_secret: str
    group_id: str
    token: int
    def __init__(self, job_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., group_id: _Optional[str] = ..., token: _Optional[int] = ...) -> None: ...

class YieldReply(_message.Message):
    __slots__ = ("released", "deferred_snapshot")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    released: bool
    deferred_snapshot: bool
    def __init__(self, released: _Optional[bool] = ..., deferred_snapshot: _Optional[bool] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("job_id", "session_secret", "node", "pid", "device_bytes", "swap", "gpus", "endpoint", "tags", "collective")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_secret: str
    node: str
    pid: int
    device_bytes: int
    swap: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    endpoint: str
    tags: _containers.RepeatedCompositeFieldContainer[TagPolicy]
    collective: bool
    def __init__(self, job_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., device_bytes: _Optional[int] = ..., swap: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., endpoint: _Optional[str] = ..., tags: _Optional[_Iterable[_Union[TagPolicy, _Mapping]]] = ..., collective: _Optional[bool] = ...) -> None: ...

class TagPolicy(_message.Message):
    __slots__ = ("tag", "policy")
    TAG_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    tag: str
    policy: str
    def __init__(self, tag: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class WorkerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeSpec(_message.Message):
    __slots__ = ("node", "gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ...) -> None: ...

class CreateGroupRequest(_message.Message):
    __slots__ = ("group_id", "nodes", "isolation", "tenants", "admins", "priorities", "max_overtakes", "max_wait_s", "sharing")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    ADMINS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_OVERTAKES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    isolation: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    admins: _containers.RepeatedScalarFieldContainer[str]
    priorities: bool
    max_overtakes: int
    max_wait_s: int
    sharing: str
    def __init__(self, group_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ..., isolation: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., admins: _Optional[_Iterable[str]] = ..., priorities: _Optional[bool] = ..., max_overtakes: _Optional[int] = ..., max_wait_s: _Optional[int] = ..., sharing: _Optional[str] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "nodes", "isolation", "tenants", "admins", "priorities", "max_overtakes", "max_wait_s", "sharing")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    ADMINS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_OVERTAKES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    isolation: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    admins: _containers.RepeatedScalarFieldContainer[str]
    priorities: bool
    max_overtakes: int
    max_wait_s: int
    sharing: str
    def __init__(self, group_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ..., isolation: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., admins: _Optional[_Iterable[str]] = ..., priorities: _Optional[bool] = ..., max_overtakes: _Optional[int] = ..., max_wait_s: _Optional[int] = ..., sharing: _Optional[str] = ...) -> None: ...

class DeleteGroupRequest(_message.Message):
    __slots__ = ("group_id", "force")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    force: bool
    def __init__(self, group_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteGroupReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    def __init__(self, groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ...) -> None: ...

class GroupRef(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class Waiter(_message.Message):
    __slots__ = ("job_id", "token", "priority")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    token: int
    priority: int
    def __init__(self, job_id: _Optional[str] = ..., token: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("job_id", "token", "leader_epoch", "restored", "elided", "bytes_moved", "granted_unix_ms", "footprint_bytes", "exclusive", "backfilled")
    class FootprintBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    BACKFILLED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    token: int
    leader_epoch: int
    restored: bool
    elided: bool
    bytes_moved: int
    granted_unix_ms: int
    footprint_bytes: _containers.ScalarMap[str, int]
    exclusive: bool
    backfilled: bool
    def __init__(self, job_id: _Optional[str] = ..., token: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., restored: _Optional[bool] = ..., elided: _Optional[bool] = ..., bytes_moved: _Optional[int] = ..., granted_unix_ms: _Optional[int] = ..., footprint_bytes: _Optional[_Mapping[str, int]] = ..., exclusive: _Optional[bool] = ..., backfilled: _Optional[bool] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("job_id", "state", "bytes", "elapsed_ms", "error", "token", "since_unix_ms", "device_bytes", "residue_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    bytes: int
    elapsed_ms: float
    error: str
    token: int
    since_unix_ms: int
    device_bytes: int
    residue_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., bytes: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., error: _Optional[str] = ..., token: _Optional[int] = ..., since_unix_ms: _Optional[int] = ..., device_bytes: _Optional[int] = ..., residue_bytes: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "agent_alive", "backend", "resident_jobs", "jobs", "device_free_bytes", "device_total_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ALIVE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_JOBS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_alive: bool
    backend: str
    resident_jobs: _containers.RepeatedScalarFieldContainer[str]
    jobs: _containers.RepeatedCompositeFieldContainer[JobState]
    device_free_bytes: int
    device_total_bytes: int
    def __init__(self, node: _Optional[str] = ..., agent_alive: _Optional[bool] = ..., backend: _Optional[str] = ..., resident_jobs: _Optional[_Iterable[str]] = ..., jobs: _Optional[_Iterable[_Union[JobState, _Mapping]]] = ..., device_free_bytes: _Optional[int] = ..., device_total_bytes: _Optional[int] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group_id", "nodes", "holder", "grant", "waiters", "node_status", "leader_epoch", "revision", "priorities", "max_overtakes", "max_wait_s", "sharing", "holders")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    NODE_STATUS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_OVERTAKES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    holder: Waiter
    grant: Grant
    waiters: _containers.RepeatedCompositeFieldContainer[Waiter]
    node_status: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    leader_epoch: int
    revision: int
    priorities: bool
    max_overtakes: int
    max_wait_s: int
    sharing: str
    holders: _containers.RepeatedCompositeFieldContainer[Grant]
    def __init__(self, group_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ..., holder: _Optional[_Union[Waiter, _Mapping]] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., waiters: _Optional[_Iterable[_Union[Waiter, _Mapping]]] = ..., node_status: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., leader_epoch: _Optional[int] = ..., revision: _Optional[int] = ..., priorities: _Optional[bool] = ..., max_overtakes: _Optional[int] = ..., max_wait_s: _Optional[int] = ..., sharing: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "lease_id", "groups", "workers", "tenant", "holds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: int
    groups: _containers.RepeatedScalarFieldContainer[str]
    workers: int
    tenant: str
    holds: _containers.RepeatedCompositeFieldContainer[Hold]
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., groups: _Optional[_Iterable[str]] = ..., workers: _Optional[int] = ..., tenant: _Optional[str] = ..., holds: _Optional[_Iterable[_Union[Hold, _Mapping]]] = ...) -> None: ...

class Hold(_message.Message):
    __slots__ = ("group_id", "token", "footprint_bytes", "exclusive")
    class FootprintBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    token: int
    footprint_bytes: _containers.ScalarMap[str, int]
    exclusive: bool
    def __init__(self, group_id: _Optional[str] = ..., token: _Optional[int] = ..., footprint_bytes: _Optional[_Mapping[str, int]] = ..., exclusive: _Optional[bool] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class ProfilesRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("job_id", "group_id", "hold_ms", "gap_ms", "wait_ms", "snapshot_ms", "restore_ms", "swap_bytes", "busy_ms", "gpu_bytes", "device_bytes", "host_bytes", "grants", "elided", "restored", "first_unix_ms", "updated_unix_ms", "live", "peak_bytes", "context_bytes", "residue_bytes")
    class GpuBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    GAP_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    FIRST_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    hold_ms: _containers.RepeatedScalarFieldContainer[int]
    gap_ms: _containers.RepeatedScalarFieldContainer[int]
    wait_ms: _containers.RepeatedScalarFieldContainer[int]
    snapshot_ms: _containers.RepeatedScalarFieldContainer[int]
    restore_ms: _containers.RepeatedScalarFieldContainer[int]
    swap_bytes: _containers.RepeatedScalarFieldContainer[int]
    busy_ms: _containers.RepeatedScalarFieldContainer[int]
    gpu_bytes: _containers.ScalarMap[str, int]
    device_bytes: int
    host_bytes: int
    grants: int
    elided: int
    restored: int
    first_unix_ms: int
    updated_unix_ms: int
    live: bool
    peak_bytes: int
    context_bytes: int
    residue_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., hold_ms: _Optional[_Iterable[int]] = ..., gap_ms: _Optional[_Iterable[int]] = ..., wait_ms: _Optional[_Iterable[int]] = ..., snapshot_ms: _Optional[_Iterable[int]] = ..., restore_ms: _Optional[_Iterable[int]] = ..., swap_bytes: _Optional[_Iterable[int]] = ..., busy_ms: _Optional[_Iterable[int]] = ..., gpu_bytes: _Optional[_Mapping[str, int]] = ..., device_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., grants: _Optional[int] = ..., elided: _Optional[int] = ..., restored: _Optional[int] = ..., first_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., live: _Optional[bool] = ..., peak_bytes: _Optional[int] = ..., context_bytes: _Optional[int] = ..., residue_bytes: _Optional[int] = ...) -> None: ...

class DeviceCapacity(_message.Message):
    __slots__ = ("id", "index", "total_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: str
    index: int
    total_bytes: int
    def __init__(self, id: _Optional[str] = ..., index: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class NodeCapacity(_message.Message):
    __slots__ = ("node", "host_free_bytes", "gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    host_free_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[DeviceCapacity]
    def __init__(self, node: _Optional[str] = ..., host_free_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[DeviceCapacity, _Mapping]]] = ...) -> None: ...

class ProfilesReply(_message.Message):
    __slots__ = ("profiles", "groups", "nodes")
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[Profile]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeCapacity]
    def __init__(self, profiles: _Optional[_Iterable[_Union[Profile, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeCapacity, _Mapping]]] = ...) -> None: ...
