"""Credentials on the client side: which bearer token (``authorization: Bearer <token>``) each call carries.

* CreateGroup and DeleteGroup: lockd's admin token, found in ``$TIMESLICE_ADMIN_TOKEN``,
  else in the file ``$TIMESLICE_ADMIN_TOKEN_FILE`` names (``timeslice up`` writes one,
  mode 0600, into its run folder; the CLI finds it there by itself); else the
  tenant's token (a tenant that administers the group may delete it).
* The reads (ListGroups, GetGroupStatus, WatchGroup, ListJobs, GetProfiles): the admin token if
  there is one (an operator sees everything), else the tenant's.
* OpenSession: the tenant's token (``$TIMESLICE_TENANT_TOKEN``, else the file
  ``$TIMESLICE_TENANT_TOKEN_FILE`` names), which names the job's tenant where lockd
  runs with tenants; else the admin token.
* Everything else carries no token: a job proves itself with its session secret.

Which call is which is ``timeslice.common.rpcs``'s.
"""
from __future__ import annotations

import os

from timeslice.common import rpcs

ENV_ADMIN_TOKEN = "TIMESLICE_ADMIN_TOKEN"
ENV_ADMIN_TOKEN_FILE = "TIMESLICE_ADMIN_TOKEN_FILE"
ENV_TENANT_TOKEN = "TIMESLICE_TENANT_TOKEN"
ENV_TENANT_TOKEN_FILE = "TIMESLICE_TENANT_TOKEN_FILE"
_MAX = 1024


def admin_token() -> str | None:
    return _token(ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE)


def _token(env: str, env_file: str) -> str | None:
    token = os.environ.get(env, "").strip()
    if token:
        return token
    path = os.environ.get(env_file)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(_MAX + 64).strip() or None
        except (OSError, UnicodeDecodeError):
            return None
    return None


def tenant_token() -> str | None:
    """The job's tenant credential: ``$TIMESLICE_TENANT_TOKEN``, else the file ``$TIMESLICE_TENANT_TOKEN_FILE``."""
    return _token(ENV_TENANT_TOKEN, ENV_TENANT_TOKEN_FILE)


def metadata_for(method: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata a call of ``method`` carries (see the module doc)."""
    if method in rpcs.ADMIN or method in rpcs.READS:
        token = admin_token() or tenant_token()
    elif method == rpcs.OPEN:
        token = tenant_token() or admin_token()
    else:
        return None
    return (("authorization", f"Bearer {token}"),) if token else None
