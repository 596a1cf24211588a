"""A session: one etcd lease kept alive in the background.

Everything ephemeral a process owns (queue entries, election candidacy,
liveness keys) is attached to its session's lease, so when the process dies
etcd deletes it all after the TTL. The loss of the lease is never silent: the
``lost`` event fires, ``on_lost`` is called, and ``check()`` raises
``SessionLost``.
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
        attempt = min(self.client.attempt_timeout, max(0.3, self.renew_deadline / 4))
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
