"""A session: one etcd lease kept alive in the background.

Everything ephemeral a process owns (queue entries, election candidacy,
liveness keys) is attached to its session's lease, so when the process dies
etcd deletes it all after the TTL. The loss of the lease is never silent: the
``lost`` event fires, ``on_lost`` is called, and ``check()`` raises
``SessionLost``.

A session is lost either because etcd said so (the lease expired or was revoked:
``expired``) or because no renewal got through for ``renew_deadline`` (etcd out of
reach, or without a majority). In the second case etcd may still hold the lease:
leases do not run out while etcd has no raft leader, and the next leader gives each
one its TTL again. ``Session.resume`` takes such a lease up again once etcd answers,
so what was attached to it (a leader's election key, and so its epoch) carries on.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from timeslice.common.errors import EtcdError, SessionClosed, SessionLost
from timeslice.common.server.etcd.backoff import Backoff
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.timing import SessionTiming

log = structlog.get_logger(__name__)


class Session:
    def __init__(
        self,
        client: EtcdClient,
        timing: SessionTiming = SessionTiming(),
        *,
        on_lost: Callable[[SessionLost], None] | None = None,
        renew_deadline: float | None = None,
    ):
        self.client = client
        self.timing = timing
        self.on_lost = on_lost
        # Give up (declare the session lost) once renewals have failed this
        # long; by default just under the TTL, when etcd may expire it anyway.
        self.renew_deadline = renew_deadline if renew_deadline is not None else timing.ttl * 0.9
        self.lease_id = 0
        self.ttl = timing.ttl
        self.lost = asyncio.Event()
        self.error: SessionLost | None = None
        self.expired = False            # lost because etcd said the lease is gone (not for silence)
        self._closed = False
        self._task: asyncio.Task | None = None
        self._last_renewed = 0.0

    async def open(self) -> Session:
        # LeaseGrant is not idempotent, but an orphaned lease from a lost reply
        # simply expires after its TTL with nothing attached, so a retry is safe.
        self.lease_id, self.ttl = await self.client.grant_lease(self.timing.ttl)
        self._last_renewed = time.monotonic()
        self._task = asyncio.create_task(self._keepalive(), name=f"keepalive-{self.lease_id:x}")
        log.debug("session_opened", lease=f"{self.lease_id:x}", ttl=self.ttl)
        return self

    @classmethod
    async def resume(cls, client: EtcdClient, lease_id: int, timing: SessionTiming = SessionTiming(), *,
                     on_lost: Callable[[SessionLost], None] | None = None,
                     renew_deadline: float | None = None) -> Session | None:
        """Take up lease ``lease_id`` again (one lost for silence, not ``expired``) if etcd still holds it:
        the session, kept alive from now on; None if etcd says it is gone. Raises ``EtcdError`` when
        etcd cannot say (out of reach again): try again later, the lease may still be there."""
        s = cls(client, timing, on_lost=on_lost, renew_deadline=renew_deadline)
        # One renewal: it both asks etcd whether the lease lives and gives it its TTL again.
        ttl = await client.keepalive_once(lease_id, timeout=s._attempt_timeout())
        if ttl <= 0:
            return None
        s.lease_id, s.ttl = lease_id, ttl
        s._last_renewed = time.monotonic()
        s._task = asyncio.create_task(s._keepalive(), name=f"keepalive-{lease_id:x}")
        log.info("session_resumed", lease=f"{lease_id:x}", ttl=ttl)
        return s

    def _attempt_timeout(self) -> float:
        return min(self.client.attempt_timeout, max(0.3, self.renew_deadline / 4))

    async def __aenter__(self) -> Session:
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def check(self) -> None:
        """Raise if the session can no longer be trusted."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise SessionClosed(f"session {self.lease_id:x} is closed")

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed

    async def _keepalive(self) -> None:
        interval = self.timing.interval
        # One renewal may not use up the renew deadline: while etcd elects a new raft
        # leader a keepalive hangs; cut it short and try again (jittered, sooner than
        # the interval), so the lease is renewed about as soon as etcd can do it.
        attempt = self._attempt_timeout()
        backoff = Backoff(0.05, interval)
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                ttl = await self.client.keepalive_once(self.lease_id, timeout=attempt)
            except EtcdError as e:
                if time.monotonic() - self._last_renewed > self.renew_deadline:
                    self._mark_lost(f"could not renew for {self.renew_deadline:.1f}s: {e}")
                    return
                log.warning("session_keepalive_failed", lease=f"{self.lease_id:x}", error=str(e))
                delay = backoff.next()
                continue
            if ttl <= 0:
                self.expired = True
                self._mark_lost("lease expired or was revoked")
                return
            self._last_renewed = time.monotonic()
            backoff.reset()
            delay = interval

    def _mark_lost(self, reason: str) -> None:
        if self.error is not None:
            return
        self.error = SessionLost(f"session lease {self.lease_id:x} lost: {reason}")
        log.warning("session_lost", lease=f"{self.lease_id:x}", reason=reason)
        self.lost.set()
        if self.on_lost is not None:
            try:
                self.on_lost(self.error)
            except Exception:  # a callback bug must not hide the loss itself
                log.exception("session_on_lost_failed")

    async def wait_lost(self) -> SessionLost:
        await self.lost.wait()
        assert self.error is not None
        return self.error

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        """Revoke the lease: everything attached to it is deleted at once."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        if self.lease_id and self.error is None:
            await self.client.revoke(self.lease_id)
        log.debug("session_closed", lease=f"{self.lease_id:x}")

    def orphan(self) -> None:
        """Stop keepalives without revoking: the lease expires after its TTL.

        For handing a lease over, and for tests that simulate a crashed owner.
        """
        self._closed = True
        self._stop()
