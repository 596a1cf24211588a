"""Every id a request carries is checked before anything else, so an ill-formed one is INVALID_ARGUMENT
on every RPC (not a session error first, nor an exception escaping a stream).

The id fields of lockd's requests (``job_id``, ``group_id``, ``node``) follow the one
grammar of ``timeslice.common.ids``; an empty one is ill-formed too (every request that
has such a field needs it).
"""
from __future__ import annotations

import functools

from timeslice.common.ids import check_id

ID_FIELDS = {"job_id": "job", "group_id": "group", "node": "node"}


def check_ids(req) -> None:
    """Raise ``InvalidIdError`` for the first ill-formed id field of ``req``."""
    present = req.DESCRIPTOR.fields_by_name
    for field, kind in ID_FIELDS.items():
        if field not in present:
            continue
        check_id(kind, getattr(req, field))


def ids_checked(fn):
    """Decorator for a unary servicer method: its request's ids are checked first."""
    @functools.wraps(fn)
    async def wrapper(self, req, context):
        check_ids(req)
        return await fn(self, req, context)
    return wrapper
