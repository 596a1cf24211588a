"""Whose a pid is, before a job registers it as a worker: the node agent's word, read fresh from etcd.

lockd cannot see a node's processes; the node agent can, and it publishes two facts
(``nodeagent/attestations.py``): which job each pid attested for over the node-local
channel (``nodes/<node>/attested/<pid>``), and which pids are the node's own servers
(``nodes/<node>/protected``). The rules, in order:

1. pid 1 and the protected pids are refused for everyone (``SystemProcess``);
2. a pid attested by another job is refused (``NotOwner``): it is that job's;
3. a pid attested by the caller is the caller's, even if another job registered it
   first: that registration was a squatter's, and it is removed (with its slot)
   before the caller's is written, so the owner is never locked out;
4. an unattested pid goes to whoever registers it first (``lockd/workers.py``), as
   before (a job may register a process it started that never opened the channel;
   an agent that requires attestation will not act on it).

The attestation is read linearizably: the agent writes it before it welcomes the
worker, and the client registers only after the welcome, so it is always there
when the owner's registration arrives, whatever this replica's mirror has seen.
"""
from __future__ import annotations

from dataclasses import dataclass

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.lockd.errors import NotOwner, SystemProcess


@dataclass(frozen=True)
class PidClaim:
    """What etcd says about a pid on a node: who attested it (None: nobody)."""

    attested_by: str | None


class Ownership:
    def __init__(self, client: EtcdClient, keys: Keys):
        self.client, self.keys = client, keys

    async def claim(self, job: str, node: str, pid: int) -> PidClaim:
        """Raise if ``job`` may not register ``pid`` on ``node``; else who attested it."""
        if pid == 1:
            raise SystemProcess(f"pid 1 on node {node!r} is init, a system process; a job registers only its "
                                "own processes")
        # Two linearizable reads (lockd/ownership.py's module doc says why not the mirror).
        prot = await self.client.range(ops.range_req(self.keys.protected(node)))
        if prot.kvs:
            why = _protected(prot.kvs[0].value).get(str(pid))
            if why:
                raise SystemProcess(f"pid {pid} on node {node!r} is a system process ({why[:80]}); a job "
                                    "registers only its own processes")
        r = await self.client.range(ops.range_req(self.keys.attested(node, pid)))
        by = _attested_job(r.kvs[0].value) if r.kvs else None
        if by is not None and by != job:
            raise NotOwner(f"pid {pid} on node {node!r} attested to the node agent as another job's process; "
                           "a job registers only its own processes")
        return PidClaim(by)


def _protected(raw: bytes) -> dict:
    try:
        pids = R.ProtectedValue.load(raw).pids
    except Exception:  # an unreadable record protects nothing: the agent still refuses to act
        return {}
    return pids if isinstance(pids, dict) else {}


def _attested_job(raw: bytes) -> str | None:
    try:
        job = R.AttestedValue.load(raw).job
    except Exception:  # an unreadable record names nobody
        return None
    return job if isinstance(job, str) else None
