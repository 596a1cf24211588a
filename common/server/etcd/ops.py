"""Builders for raw etcd v3 transaction pieces (compares, puts, ranges, deletes).

aetcd's own transaction helpers cannot express ranges sorted by create
revision, limits, or create-revision bounds, which the FIFO queue needs, so we
build the protobuf messages from aetcd's generated bindings directly.
"""
from __future__ import annotations

from aetcd import rpc

from timeslice.common.server.keys import prefix_range_end

_RESULT = {
    "==": rpc.Compare.EQUAL,
    "!=": rpc.Compare.NOT_EQUAL,
    ">": rpc.Compare.GREATER,
    "<": rpc.Compare.LESS,
}


def _cmp(key: bytes, op: str, target, field: str, value) -> rpc.Compare:
    c = rpc.Compare(key=key, result=_RESULT[op], target=target)
    setattr(c, field, value)
    return c


def create_rev(key: bytes, op: str, rev: int) -> rpc.Compare:
    """Compare a key's create_revision (0 means the key does not exist)."""
    return _cmp(key, op, rpc.Compare.CREATE, "create_revision", rev)


def mod_rev(key: bytes, op: str, rev: int) -> rpc.Compare:
    return _cmp(key, op, rpc.Compare.MOD, "mod_revision", rev)


def value_is(key: bytes, op: str, value: bytes) -> rpc.Compare:
    return _cmp(key, op, rpc.Compare.VALUE, "value", value)


def put(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes, *, prefix: bool = False, prev_kv: bool = False) -> rpc.RequestOp:
    req = rpc.DeleteRangeRequest(key=key, prev_kv=prev_kv)
    if prefix:
        req.range_end = prefix_range_end(key)
    return rpc.RequestOp(request_delete_range=req)


def range_req(
    key: bytes,
    *,
    prefix: bool = False,
    limit: int = 0,
    by_create: str | None = None,
    max_create_revision: int = 0,
    revision: int = 0,
    count_only: bool = False,
    keys_only: bool = False,
) -> rpc.RangeRequest:
    """A RangeRequest; ``by_create`` = 'asc'|'desc' sorts by create_revision."""
    req = rpc.RangeRequest(
        key=key,
        limit=limit,
        revision=revision,
        count_only=count_only,
        keys_only=keys_only,
        max_create_revision=max_create_revision,
    )
    if prefix:
        req.range_end = prefix_range_end(key)
    if by_create:
        req.sort_target = rpc.RangeRequest.CREATE
        req.sort_order = rpc.RangeRequest.ASCEND if by_create == "asc" else rpc.RangeRequest.DESCEND
    return req


def get(key: bytes, **kw) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=range_req(key, **kw))


def first_in(prefix: bytes) -> rpc.RequestOp:
    """The oldest key (lowest create_revision) below ``prefix``: the queue head."""
    return get(prefix, prefix=True, limit=1, by_create="asc")


def mod_revs_below(prefix: bytes, rev: int) -> rpc.Compare:
    """True while every key below ``prefix`` was last written before revision ``rev`` (and when
    there is none): "nothing under the prefix was created or changed since a read at ``rev - 1``"."""
    c = mod_rev(prefix, "<", rev)
    c.range_end = prefix_range_end(prefix)
    return c


def nested(compare, success=(), failure=()) -> rpc.RequestOp:
    """A transaction inside a transaction's branch: an outer guard around an inner decision."""
    return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=list(compare), success=list(success),
                                                    failure=list(failure)))
