"""The admin credential on the client side: which bearer token admin calls carry.

CreateGroup and DeleteGroup need lockd's admin token (``authorization: Bearer
<token>`` metadata). The client finds it in ``$TIMESLICE_ADMIN_TOKEN``, else in
the file ``$TIMESLICE_ADMIN_TOKEN_FILE`` names (``timeslice up`` writes one,
mode 0600, into its run folder; the CLI finds it there by itself). Other calls
carry no token: a job proves itself with its session secret alone.
"""
from __future__ import annotations

import os

ENV_ADMIN_TOKEN = "TIMESLICE_ADMIN_TOKEN"
ENV_ADMIN_TOKEN_FILE = "TIMESLICE_ADMIN_TOKEN_FILE"
ADMIN_METHODS = frozenset({"CreateGroup", "DeleteGroup"})
_MAX = 1024


def admin_token() -> str | None:
    token = os.environ.get(ENV_ADMIN_TOKEN, "").strip()
    if token:
        return token
    path = os.environ.get(ENV_ADMIN_TOKEN_FILE)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(_MAX + 64).strip() or None
        except (OSError, UnicodeDecodeError):
            return None
    return None


def metadata_for(method: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata a call of ``method`` carries: the admin token for admin calls, else nothing."""
    if method not in ADMIN_METHODS:
        return None
    token = admin_token()
    return (("authorization", f"Bearer {token}"),) if token else None
