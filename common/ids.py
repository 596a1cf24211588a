"""The id grammar: what a group, job or node id may look like.

Ids become etcd key segments, so they must never contain '/', must not be
empty, and must be short enough to keep keys readable. The grammar is the
DNS-label-like set ``[A-Za-z0-9][A-Za-z0-9._-]{0,126}`` (1..127 chars), which
also fits Kubernetes object names. Anything else is rejected with
``InvalidIdError`` before any etcd call is made.
"""
from __future__ import annotations

import re

from timeslice.common.errors import InvalidIdError

MAX_ID_LEN = 127
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")


def check_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid id of ``kind`` (for the message), else raise."""
    if not isinstance(value, str) or value == "":
        raise InvalidIdError(f"{kind} id must be a non-empty string")
    if len(value) > MAX_ID_LEN:
        raise InvalidIdError(f"{kind} id is {len(value)} characters; the limit is {MAX_ID_LEN}")
    if not _ID_RE.fullmatch(value) or value in (".", ".."):
        raise InvalidIdError(
            f"{kind} id {value!r} is ill-formed: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value
