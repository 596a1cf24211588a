"""The lock API's methods by what a call proves; lockd and the client both read these lists.

``ADMIN``: the admin credential (lockd's ``Gate``; with tenants, a tenant that administers a
group may delete it). ``READS``: a credential where read auth is on (``lockd/callers.py``).
``SESSION``: a job's own calls, proven by its session secret (UNAUTHENTICATED there: the
client's ``AuthError``). ``OPEN``: OpenSession, which names a tenant by its token. Every
method of ``proto/lockd.proto`` is in exactly one (``tests/test_rpcs.py``).
"""
from __future__ import annotations

ADMIN = frozenset({"CreateGroup", "DeleteGroup"})
READS = frozenset({"ListGroups", "GetGroupStatus", "WatchGroup", "ListJobs", "GetProfiles"})
SESSION = frozenset({"CloseSession", "KeepAlive", "Acquire", "Yield", "RegisterWorker", "UnregisterWorker"})
OPEN = "OpenSession"
