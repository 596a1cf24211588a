"""The agent's etcd lease: opened at start, replaced when lost, given back at stop.

What must vanish with the agent is leased to this one session: the liveness key
(``nodes/<node>/agent``, so the leader declares a node's agent dead once it lapses), the
attestations and the protected list. A lease lost while the agent lives on (etcd
unreachable past the TTL, or a write said so) is replaced by a new one; the listeners
told of it (``LeaseListener``: the upkeep) then move the liveness key to it at once. Renewals are one at a time: several writers
that saw the same lease fail renew it once.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from timeslice.common.errors import TimesliceError
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.session import Session
from timeslice.common.server.etcd.timing import SessionTiming

log = structlog.get_logger(__name__)


class LeaseListener(Protocol):
    def lease_renewed(self) -> None:
        """The agent's lease was replaced: what lives on it must move to the new one."""


class AgentLease:
    def __init__(self, client: EtcdClient, timing: SessionTiming):
        self.client, self.timing = client, timing
        self.session: Session | None = None
        self.listeners: list[LeaseListener] = []
        self._lock = asyncio.Lock()

    async def open(self) -> Session:
        """Grant the lease and keep it alive (at start)."""
        self.session = await Session(self.client, self.timing).open()
        return self.session

    def live(self) -> Session:
        """The agent's etcd session (opened by open(); replaced by renew())."""
        if self.session is None:
            raise RuntimeError("the agent has not started")
        return self.session

    def lease_id(self) -> int:
        return self.live().lease_id

    def alive(self) -> bool:
        return self.session is not None and self.session.alive

    async def renew(self, failed_lease: int | None = None) -> None:
        """Replace a lost lease (etcd unreachable past the TTL, or said so by a write)."""
        async with self._lock:
            s = self.live()
            if (s.lease_id != failed_lease) if failed_lease is not None else s.alive:
                return                          # renewed already, or nothing wrong
            s.orphan()
            self.session = new = await Session(self.client, self.timing).open()
            log.warning("agent_session_renewed", old=f"{s.lease_id:x}", lease=f"{new.lease_id:x}")
            for listener in self.listeners:     # the liveness key must move to the new lease
                listener.lease_renewed()

    async def close(self) -> None:
        """Give the lease back (at stop): the keys leased to it go with it."""
        if self.session is not None:
            try:
                await self.session.close()
            except TimesliceError as e:
                log.warning("session_close_failed", error=str(e))
