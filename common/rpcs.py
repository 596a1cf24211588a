"""The lock API's methods by what a call proves: one list that lockd and the client both read.

* ``ADMIN``: the admin credential (lockd's ``Gate``, ``lockd/server.py``; with tenants, a
  tenant that administers the group may delete it too). The client sends the admin token
  (``timeslice.auth``).
* ``READS``: the reads. A credential where read auth is on (``--require-read-auth``, or
  tenants: ``lockd/callers.py``); the client sends the admin token if it has one, else
  the tenant's.
* ``SESSION``: a job's own calls, proven by its session secret; UNAUTHENTICATED there
  means the secret no longer opens the session (the client's ``AuthError``).
* ``OPEN``: OpenSession, the one call that names a tenant by its token.

Every method of ``proto/lockd.proto``'s service is in exactly one (``tests/test_rpcs.py``):
a new RPC is placed here (docs/ARCHITECTURE.md's checklist "Add a lock RPC").
"""
from __future__ import annotations

ADMIN = frozenset({"CreateGroup", "DeleteGroup"})
READS = frozenset({"ListGroups", "GetGroupStatus", "WatchGroup", "ListJobs", "GetProfiles"})
SESSION = frozenset({"CloseSession", "KeepAlive", "Acquire", "Yield", "RegisterWorker", "UnregisterWorker"})
OPEN = "OpenSession"
