"""The job's session: opened lazily, kept alive, surfaced when lost, and what its keepalives report.

The session is opened by the first call that needs it (acquire, yield,
register_worker), not by the constructor: a client can be made at import time,
before lockd is up, and admin-only users (the CLI) never open one. Once open,
a task renews it every TTL/3 with KeepAlive. If the session is lost (lockd
answers ABORTED, or no keepalive succeeded for a whole TTL), every later
session call raises ``SessionLostError`` and ``on_session_lost(error)`` fires
once; the client then refuses session calls until ``reset_session()``.

The keepalive watchdog counts from when the OpenSession attempt that opened the
session was sent (the lease is younger), not from when the call began: a
restarted job's OpenSession may wait a whole TTL for its predecessor's session
to expire.

A session the client declared lost on its own (no keepalive succeeded for a
TTL: lockd or etcd unreachable) may still be alive in etcd, most of all after an
etcd outage, which gives every lease a fresh TTL when it ends. Its queue
entries would then block the jobs behind it for that long, so the client ends
it at lockd (CloseSession with ``lost``) as soon as a replica answers, trying
for up to ``LOST_END_WINDOW_S``; ``reset_session()`` and ``close()`` give that
a moment first, so the next session of the job id is not refused as a duplicate.

A KeepAlive reply also lists the groups an admin deleted under the job: the
keepalive hands it to revocations.py. After each renewal that succeeds, the
keepalive retries the withdrawals still pending (holds.py, withdraw.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import TYPE_CHECKING

from timeslice import errors as E
from timeslice.core import ClientCore, SessionInfo
from timeslice.logs import get_logger
from timeslice.proto import lockd_pb2 as pb
from timeslice.retry import Call
from timeslice.revocations import Revocations
from timeslice.transport import Transport
from timeslice.usercode import CALLER, UserCode

if TYPE_CHECKING:
    from timeslice.holds import Withdrawals

log = get_logger(__name__)

#: How long a client keeps trying to end, at lockd, a session it declared lost (s). Past this
#: the lease has long expired (etcd gives a lease at most its TTL more after an outage).
LOST_END_WINDOW_S = 600.0


class Sessions:
    """Open, keep alive, verify, reset and close the job's session."""

    def __init__(self, core: ClientCore, transport: Transport, user: UserCode, revocations: Revocations,
                 withdrawals: Withdrawals):
        self.core, self.transport, self.user = core, transport, user
        self.revocations, self.withdrawals = revocations, withdrawals
        self._open_mu: asyncio.Lock | None = None      # made on the loop, at first use
        self._ka_task: asyncio.Task | None = None
        self._ending: asyncio.Task | None = None        # ends a session this client declared lost

    async def ensure(self) -> SessionInfo:
        """The open session; opens it on first use."""
        core = self.core
        core.check_usable(Call.ACQUIRE)
        if core.session is not None:
            return core.session
        if self._open_mu is None:
            self._open_mu = asyncio.Lock()
        async with self._open_mu:
            if core.session is not None:
                return core.session
            cfg = core.config
            t0 = time.monotonic()
            sent = [t0]
            # An older session of this job id (a restarted job, or our own attempt
            # whose reply was lost) is waited out: it expires within its TTL.
            reply = await self.transport.invoke(Call.OPEN_SESSION, lambda: core.open_req(sent),
                                                deadline=t0 + cfg.timeout + cfg.session_ttl)
            s = SessionInfo(reply.session_secret, reply.lease_id, reply.ttl_seconds or cfg.session_ttl, sent[0])
            with core.mu:
                core.session = s
            log.info("session_opened", job=core.job_id, lease=s.lease_id, ttl=s.ttl, target=core.target)
            self._ka_task = asyncio.create_task(self._keepalive_loop(s), name=f"timeslice-keepalive-{core.job_id}")
            return s

    async def open_session(self) -> int:
        """Open the session now instead of on first use; returns its lease id."""
        return (await self.ensure()).lease_id

    async def _keepalive_loop(self, s: SessionInfo) -> None:
        CALLER.set(None)           # this task outlives the call that opened the session
        core = self.core
        cfg = core.config
        last_ok = s.opened_at
        while True:
            await asyncio.sleep(cfg.keepalive_period)
            if core.session is not s or core.closed or core.closing:
                return
            t0 = time.monotonic()
            try:
                reply = await self.transport.invoke(Call.KEEPALIVE, core.ref, deadline=last_ok + s.ttl,
                                                    cap=cfg.keepalive_attempt_timeout)
                last_ok = t0
                self.revocations.heard(reply)
                if self.withdrawals.pending():
                    await self.withdrawals.run(cfg.keepalive_period / 2)
            except (E.SessionLostError, E.AuthError, E.ClientClosedError):
                return                                  # invoke recorded the loss
            except E.TimesliceClientError as e:
                if time.monotonic() - last_ok >= s.ttl:
                    lost = E.SessionLostError(
                        f"no keepalive of job {core.job_id!r} succeeded for {s.ttl}s (last error: {e}); "
                        "its lease has expired")
                    cb = core.take_loss(lost, s)
                    if core.lost is lost:
                        self._start_ending(s)           # etcd may hold the lease still: end it at lockd
                    await self.user.fire(cb, lost, "on_session_lost")
                    return
                log.warning("keepalive_failed", job=core.job_id, error=str(e))

    async def verify(self) -> None:
        """One KeepAlive: raises SessionLostError if the session is really gone."""
        core = self.core
        reply = await self.transport.invoke(Call.KEEPALIVE, core.ref, deadline=core.deadline(core.config.timeout),
                                            cap=core.config.keepalive_attempt_timeout)
        self.revocations.heard(reply)

    # -- a session declared lost, ended at lockd ---------------------------------------
    def _start_ending(self, s: SessionInfo) -> None:
        if self._ending is None or self._ending.done():
            self._ending = asyncio.create_task(self._end_lost(s), name=f"timeslice-end-lost-{self.core.job_id}")

    async def _end_lost(self, s: SessionInfo) -> None:
        """CloseSession(lost) of ``s`` until a replica answers (or the window passes, or we close)."""
        CALLER.set(None)           # this task outlives the call that noticed the loss
        core = self.core
        cfg, give_up = core.config, time.monotonic() + LOST_END_WINDOW_S
        tries = 0
        while not core.closed and time.monotonic() < give_up:
            try:
                reply = await self.transport.invoke(Call.CLOSE_SESSION, lambda: pb.SessionRef(
                    job_id=core.job_id, session_secret=s.secret, lost=True), deadline=core.deadline(cfg.timeout))
                log.info("lost_session_ended", job=core.job_id, lease=s.lease_id, ended=reply.closed,
                         hint="its queue entries and workers went with it" if reply.closed else
                         "it had ended already")
                return
            except (E.AuthError, E.SessionLostError):
                return                                  # a newer session of the job id replaced it, or gone
            except E.TimesliceClientError as e:
                tries += 1
                log.info("lost_session_end_retry", job=core.job_id, lease=s.lease_id, error=str(e)[:200])
                # Full jitter, doubling to the policy's cap: clients that lost their sessions in one
                # outage do not all come back at once.
                await asyncio.sleep(random.uniform(0, min(cfg.retry.max_backoff, cfg.retry.initial_backoff * 2 ** tries)))

    async def _await_ending(self, budget: float) -> None:
        """Give the ending of a lost session up to ``budget`` s (it goes on in the background after)."""
        t = self._ending
        if t is not None and not t.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(t), budget)

    def drop_ending(self) -> None:
        """The client is closed: stop trying to end a lost session."""
        if self._ending is not None:
            self._ending.cancel()

    # -- reset and close -------------------------------------------------------------
    async def reset(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        core = self.core
        s, lost = core.session, core.lost
        self.stop_keepalive()
        if s is not None and lost is None:
            await self._close_session(s)
        elif lost is not None:
            await self._await_ending(core.config.timeout)   # so the new session is not a duplicate
        with core.mu:
            core.session, core.lost = None, None
            core.grants.clear()

    def stop_keepalive(self) -> asyncio.Task | None:
        """Stop the keepalive (and the revocation checks); the task to await, unless it is this one."""
        t, self._ka_task = self._ka_task, None
        self.revocations.stop()
        if t is not None and t is not asyncio.current_task():
            t.cancel()
            return t
        return None

    async def end(self, budget: float) -> None:
        """At close: close a live session, or give the ending of a lost one up to ``budget`` s."""
        core = self.core
        s = core.session
        if s is not None and core.lost is None:
            await self._close_session(s, budget)
        elif core.lost is not None:
            await self._await_ending(budget)        # a session it declared lost: ended at lockd if it can

    async def _close_session(self, s: SessionInfo, budget: float = 5.0) -> None:
        core = self.core
        try:
            await self.transport.invoke(Call.CLOSE_SESSION, core.ref,
                                        deadline=core.deadline(min(core.config.timeout, budget)))
            log.info("session_closed", job=core.job_id, lease=s.lease_id)
        except E.TimesliceClientError as e:
            log.warning("session_close_failed", job=core.job_id, error=str(e),
                        hint="the lease expires by itself within its TTL")
