"""Every write the node agent makes to etcd, and why each is safe.

* ``answer``: a status answering an intent, in a transaction guarded by
  ``mod_revision(intent) == intent_revision``. A slow op whose intent was
  replaced meanwhile writes nothing (docs/ARCHITECTURE.md, invariant 5). The refreshed liveness
  key rides in the same transaction, so the leader never sees the op's result
  beside free-memory figures from before it.
* ``put_agent``: the liveness key alone, attached to the agent's lease.
* ``correct``: a status brought in line with reality (a process died, a
  direct call moved the job), guarded by the status's own mod revision so it
  never overwrites a status written since it was read.

Retries: each of these writes puts a fixed value under a guard, so applying it
twice is the same as once. An unknown outcome (deadline exceeded during an etcd
failover) is therefore resolved by sending it again until etcd answers,
which is exactly "read then decide" in one round trip: the guard reads, the
put is idempotent. A lease that has expired under us (a long partition) is
renewed first: the key must live on the new lease.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aetcd import rpc

from timeslice.common.errors import EtcdError, EtcdUnavailable, OutcomeUnknown
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.nodeagent.intents import Intent
from timeslice.nodeagent.lease import AgentLease

log = structlog.get_logger(__name__)

Build = Callable[[], tuple[list, list, list]]


class Reporter:
    def __init__(self, client: EtcdClient, keys: Keys, node: str, lease: AgentLease, max_delay: float = 2.0):
        """``lease``: the agent's lease, which the liveness key lives on (renewed here when a write finds
        it gone)."""
        self.client, self.keys, self.node, self.lease = client, keys, node, lease
        self.max_delay = max_delay
        self.last_agent: R.AgentValue | None = None
        self.newer_revision = 0          # of the intent that superseded the last answer
        self._used_lease = 0

    async def _txn(self, what: str, build: Build) -> rpc.TxnResponse:
        delay = 0.05
        while True:
            compare, success, failure = build()
            try:
                return await self.client.txn(compare, success, failure)
            except (OutcomeUnknown, EtcdUnavailable) as e:
                log.warning("etcd_write_retry", what=what, error=str(e), delay=delay)
            except EtcdError as e:
                if "lease not found" not in str(e):
                    raise
                log.warning("agent_lease_gone", what=what, error=str(e))
                await self.lease.renew(self._used_lease)
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_delay)

    def _agent_put(self, raw: bytes) -> rpc.RequestOp:
        self._used_lease = self.lease.lease_id()
        return ops.put(self.keys.agent(self.node), raw, self._used_lease)

    async def keep_lease(self) -> None:
        """Replace the agent's lease if it was lost while nothing was written (etcd unreachable past the TTL)."""
        if not self.lease.alive():
            await self.lease.renew()

    async def answer(self, intent: Intent, status: R.StatusValue, agent: R.AgentValue | None = None) -> int:
        """Write ``status`` if the intent is still the one it answers. Returns the revision, or 0."""
        ikey, skey = self.keys.intent(self.node, intent.job), self.keys.status(self.node, intent.job)
        raw_status, raw_agent = status.dump(), agent.dump() if agent else b""

        def build():
            success = [ops.put(skey, raw_status)]
            if agent is not None:
                success.append(self._agent_put(raw_agent))
            # One RPC: the guard is the intent's mod revision, the failure branch
            # tells us what replaced it (for the log).
            return [ops.mod_rev(ikey, "==", intent.revision)], success, [ops.get(ikey)]

        resp = await self._txn("status", build)
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            self.newer_revision = kvs[0].mod_revision if kvs else 0
            log.info("status_superseded", **intent.log_ctx(), state=status.state, outcome=status.outcome,
                     newer_revision=self.newer_revision)
            return 0
        if agent is not None:
            self.last_agent = agent
        return resp.header.revision

    async def put_agent(self, agent: R.AgentValue) -> int:
        raw = agent.dump()
        resp = await self._txn("agent", lambda: ([], [self._agent_put(raw)], []))
        self.last_agent = agent
        return resp.header.revision

    async def correct(self, job: str, status: R.StatusValue, expect_mod_revision: int) -> int:
        """Replace the job's status if it is still the one read at ``expect_mod_revision`` (0: absent)."""
        skey = self.keys.status(self.node, job)
        raw = status.dump()
        resp = await self._txn("correct", lambda: ([ops.mod_rev(skey, "==", expect_mod_revision)],
                                                    [ops.put(skey, raw)], []))
        return resp.header.revision if resp.succeeded else 0

