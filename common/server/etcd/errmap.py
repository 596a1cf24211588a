"""The table from an etcd gRPC error to this project's typed error (and so to the status our callers get).

Only conditions that go away by themselves are UNAVAILABLE (the caller retries):
etcd unreachable, no leader, a request timed out, too many requests, an auth
token that expired (the client re-authenticates). etcd 3.4 also answers a
request whose deadline ran out on the member (a linearizable read while the
cluster has no leader) with status UNKNOWN and Go's "context deadline exceeded"
(its gRPC server turns a bare context error into UNKNOWN): that is a timeout
too (``TRANSIENT_UNKNOWN``), never INTERNAL. Everything else keeps its
meaning: a vanished lease is ABORTED (the session is gone), an oversized request
INVALID_ARGUMENT, a full database RESOURCE_EXHAUSTED, refused credentials or
any other surprise INTERNAL. ``ETCD_ERROR_TABLE`` is the table; tests walk it.
"""
from __future__ import annotations

import grpc

from timeslice.common.errors import (
    EtcdError,
    EtcdLeaseGone,
    EtcdNoSpace,
    EtcdRefused,
    EtcdRequestTooLarge,
    EtcdUnavailable,
    OutcomeUnknown,
)

_TRANSIENT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.CANCELLED})

#: Messages of an UNKNOWN status that mean the call timed out or its connection went, not that
#: etcd refused it (Go's context errors and gRPC transport errors passed through as they are).
TRANSIENT_UNKNOWN = ("context deadline exceeded", "context canceled", "transport is closing",
                     "connection reset", "connection refused", "broken pipe")

#: (etcd status code, a substring of etcd's message or "" for any) -> error class; first match wins.
ETCD_ERROR_TABLE: tuple[tuple[grpc.StatusCode, str, type[EtcdError]], ...] = (
    (grpc.StatusCode.NOT_FOUND, "lease not found", EtcdLeaseGone),
    (grpc.StatusCode.INVALID_ARGUMENT, "request is too large", EtcdRequestTooLarge),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max", EtcdRequestTooLarge),   # our gRPC's send limit
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "database space exceeded", EtcdNoSpace),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests", EtcdUnavailable),
    (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token", EtcdUnavailable),       # expired: re-auth
    (grpc.StatusCode.FAILED_PRECONDITION, "invalid auth token", EtcdUnavailable),
    (grpc.StatusCode.UNAUTHENTICATED, "", EtcdRefused),
    (grpc.StatusCode.PERMISSION_DENIED, "", EtcdRefused),
    (grpc.StatusCode.FAILED_PRECONDITION, "authentication failed", EtcdRefused),
    # Auth changed between our token's issue and this request: refused before it applied, and the
    # next request (re-authenticated) succeeds.
    (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old", EtcdUnavailable),
    (grpc.StatusCode.INVALID_ARGUMENT, "", EtcdRefused),           # a malformed request of ours: a bug
    (grpc.StatusCode.OUT_OF_RANGE, "", EtcdRefused),               # compacted / future revision
)

MAX_DETAIL = 300


def map_error(e: grpc.aio.AioRpcError, *, write: bool) -> EtcdError:
    code = e.code()
    detail = (e.details() or "")[:MAX_DETAIL]
    low = detail.lower()
    if code in _TRANSIENT or (code == grpc.StatusCode.UNKNOWN and any(t in low for t in TRANSIENT_UNKNOWN)):
        # A write that failed this way may still have been applied (the reply was
        # lost, not necessarily the request): the caller must read to find out.
        if write:
            return OutcomeUnknown(f"etcd write outcome unknown: {code.name}: {detail}")
        return EtcdUnavailable(f"etcd unavailable: {code.name}: {detail}")
    for c, needle, cls in ETCD_ERROR_TABLE:
        if c == code and needle in low:
            return cls(f"etcd: {code.name}: {detail}")
    return EtcdRefused(f"etcd error {code.name}: {detail}")
