from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperationRequest(_message.Message):
    __slots__ = ("job_id", "pids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("operation_id", "op", "job_id", "state", "bytes", "elapsed_ms", "error", "pids")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    op: str
    job_id: str
    state: str
    bytes: int
    elapsed_ms: float
    error: str
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, operation_id: _Optional[str] = ..., op: _Optional[str] = ..., job_id: _Optional[str] = ..., state: _Optional[str] = ..., bytes: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., error: _Optional[str] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "total_bytes", "free_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    total_bytes: int
    free_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ...) -> None: ...

class ProcessState(_message.Message):
    __slots__ = ("pid", "job_id", "state", "device_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    job_id: str
    state: str
    device_bytes: int
    def __init__(self, pid: _Optional[int] = ..., job_id: _Optional[str] = ..., state: _Optional[str] = ..., device_bytes: _Optional[int] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("node", "backend", "version", "gpus", "host_free_bytes", "processes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    node: str
    backend: str
    version: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    host_free_bytes: int
    processes: _containers.RepeatedCompositeFieldContainer[ProcessState]
    def __init__(self, node: _Optional[str] = ..., backend: _Optional[str] = ..., version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., host_free_bytes: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[ProcessState, _Mapping]]] = ...) -> None: ...
