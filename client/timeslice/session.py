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

A KeepAlive reply also lists the groups an admin deleted under the job
(``revoked_groups``, see lockd/revocations.py and grants.py): a grant held on one
is confirmed gone with a status read, dropped, acknowledged to lockd, and
reported through ``on_grant_revoked`` and a ``grant_revoked`` log event, within
one keepalive period of the deletion.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

from timeslice import errors as E
from timeslice.core import Session
from timeslice.logs import get_logger
from timeslice.model import Grant, GroupStatus
from timeslice.proto import lockd_pb2 as pb
from timeslice.retry import Call
from timeslice.transport import CALLER, Transport

log = get_logger(__name__)

#: How long a client keeps trying to end, at lockd, a session it declared lost (s). Past this
#: the lease has long expired (etcd gives a lease at most its TTL more after an outage).
LOST_END_WINDOW_S = 600.0


class Sessions(Transport):
    """Open, keep alive, verify, reset and close the job's session."""

    def _init_session(self) -> None:
        self._open_mu: asyncio.Lock | None = None      # made on the loop, at first use
        self._ka_task: asyncio.Task | None = None
        self._notices: dict[tuple[str, int], asyncio.Task] = {}   # revocations being looked into
        self._ending: asyncio.Task | None = None        # ends a session this client declared lost

    async def _ensure_session(self) -> Session:
        self._check_usable(Call.ACQUIRE)
        if self._session is not None:
            return self._session
        if self._open_mu is None:
            self._open_mu = asyncio.Lock()
        async with self._open_mu:
            if self._session is not None:
                return self._session
            cfg = self.config
            t0 = time.monotonic()
            sent = [t0]
            # An older session of this job id (a restarted job, or our own attempt
            # whose reply was lost) is waited out: it expires within its TTL.
            reply = await self._invoke(Call.OPEN_SESSION, lambda: self._open_req(sent),
                                       deadline=t0 + cfg.timeout + cfg.session_ttl)
            s = Session(reply.session_secret, reply.lease_id, reply.ttl_seconds or cfg.session_ttl, sent[0])
            with self._mu:
                self._session = s
            log.info("session_opened", job=self.job_id, lease=s.lease_id, ttl=s.ttl, target=self.target)
            self._ka_task = asyncio.create_task(self._keepalive_loop(s), name=f"timeslice-keepalive-{self.job_id}")
            return s

    async def open_session(self) -> int:
        """Open the session now instead of on first use; returns its lease id."""
        return (await self._ensure_session()).lease_id

    async def _keepalive_loop(self, s: Session) -> None:
        CALLER.set(None)           # this task outlives the call that opened the session
        cfg = self.config
        last_ok = s.opened_at
        while True:
            await asyncio.sleep(cfg.keepalive_period)
            if self._session is not s or self._closed or self._closing:
                return
            t0 = time.monotonic()
            try:
                reply = await self._invoke(Call.KEEPALIVE, self._ref, deadline=last_ok + s.ttl,
                                           cap=cfg.keepalive_attempt_timeout)
                last_ok = t0
                self._heard(reply)
                if self._withdraw:
                    await self._withdraw_pending(cfg.keepalive_period / 2)
            except (E.SessionLostError, E.AuthError, E.ClientClosedError):
                return                                  # _invoke recorded the loss
            except E.TimesliceClientError as e:
                if time.monotonic() - last_ok >= s.ttl:
                    lost = E.SessionLostError(
                        f"no keepalive of job {self.job_id!r} succeeded for {s.ttl}s (last error: {e}); "
                        "its lease has expired")
                    cb = self._take_loss(lost, s)
                    if self._lost is lost:
                        self._start_ending(s)           # etcd may hold the lease still: end it at lockd
                    await self._fire(cb, lost, "on_session_lost")
                    return
                log.warning("keepalive_failed", job=self.job_id, error=str(e))

    async def _verify_session(self) -> None:
        """One KeepAlive: raises SessionLostError if the session is really gone."""
        reply = await self._invoke(Call.KEEPALIVE, self._ref, deadline=self._deadline(self.config.timeout),
                                   cap=self.config.keepalive_attempt_timeout)
        self._heard(reply)

    async def _withdraw_pending(self, budget: float) -> None:
        raise NotImplementedError                    # holds.py

    async def _release_quietly(self, group_id: str, token: int) -> None:
        raise NotImplementedError                    # holds.py

    # -- revocations ------------------------------------------------------------------
    def _heard(self, reply) -> None:
        """Look into a KeepAlive reply's revoked groups (off the keepalive's path: a slow status
        read or user callback must never delay the next renewal)."""
        for grant in self._grants.suspects(getattr(reply, "revoked_groups", ())):
            key = (grant.group_id, grant.token)
            if key not in self._notices:
                t = asyncio.create_task(self._check_revoked(grant), name=f"timeslice-revoked-{grant.group_id}")
                self._notices[key] = t
                t.add_done_callback(self._notice_done)

    def _notice_done(self, task: asyncio.Task) -> None:
        for key, t in list(self._notices.items()):
            if t is task:
                del self._notices[key]

    async def _check_revoked(self, grant: Grant) -> None:
        CALLER.set(None)
        try:
            st = await self._invoke(Call.GROUP_STATUS, lambda: pb.GroupRef(group_id=grant.group_id),
                                    deadline=self._deadline(self.config.timeout))
            status = GroupStatus.from_pb(st)
            head = status.holder
            if self._grants.still_holds(grant, head.job_id if head else None, head.token if head else None):
                return                                  # a notice left from an earlier wait on the group
        except E.UnknownGroupError:
            pass                                        # deleted and not re-created
        except E.TimesliceClientError as e:
            log.warning("revocation_check_failed", job=self.job_id, group=grant.group_id, error=str(e))
            return                                      # the next keepalive lists it again
        err = self._grants.revoke(grant)
        if err is None:
            return                                      # yielded (or lost) meanwhile
        await self._acknowledge_revoked(grant)
        await self._fire(self._on_grant_revoked, err, "on_grant_revoked")

    async def _acknowledge_revoked(self, grant: Grant) -> None:
        """A Yield of the deleted hold's token: lockd answers group_deleted and drops its notice,
        so later keepalives stop listing the group (a later grant on a re-created group must
        not look revoked)."""
        try:
            await self._invoke(Call.YIELD, lambda: self._yield_req(grant.group_id, grant.token),
                               deadline=self._deadline(self.config.timeout))
        except (E.GroupRevokedError, E.NotHolderError, E.StaleTokenError, E.UnknownGroupError):
            pass                                        # acknowledged, or nothing left to acknowledge
        except E.TimesliceClientError as e:
            log.warning("revocation_ack_failed", job=self.job_id, group=grant.group_id, error=str(e))

    # -- a session declared lost, ended at lockd ---------------------------------------
    def _start_ending(self, s: Session) -> None:
        if self._ending is None or self._ending.done():
            self._ending = asyncio.create_task(self._end_lost(s), name=f"timeslice-end-lost-{self.job_id}")

    async def _end_lost(self, s: Session) -> None:
        """CloseSession(lost) of ``s`` until a replica answers (or the window passes, or we close)."""
        CALLER.set(None)           # this task outlives the call that noticed the loss
        cfg, give_up = self.config, time.monotonic() + LOST_END_WINDOW_S
        tries = 0
        while not self._closed and time.monotonic() < give_up:
            try:
                reply = await self._invoke(Call.CLOSE_SESSION, lambda: pb.SessionRef(
                    job_id=self.job_id, session_secret=s.secret, lost=True), deadline=self._deadline(cfg.timeout))
                log.info("lost_session_ended", job=self.job_id, lease=s.lease_id, ended=reply.closed,
                         hint="its queue entries and workers went with it" if reply.closed else
                         "it had ended already")
                return
            except (E.AuthError, E.SessionLostError):
                return                                  # a newer session of the job id replaced it, or gone
            except E.TimesliceClientError as e:
                tries += 1
                log.info("lost_session_end_retry", job=self.job_id, lease=s.lease_id, error=str(e)[:200])
                # Full jitter, doubling to the policy's cap: clients that lost their sessions in one
                # outage do not all come back at once.
                await asyncio.sleep(random.uniform(0, min(cfg.retry.max_backoff, cfg.retry.initial_backoff * 2 ** tries)))

    async def _await_ending(self, budget: float) -> None:
        """Give the ending of a lost session up to ``budget`` s (it goes on in the background after)."""
        t = self._ending
        if t is not None and not t.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(t), budget)

    # -- reset and close -------------------------------------------------------------
    async def reset_session(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        s, lost = self._session, self._lost
        self._stop_keepalive()
        if s is not None and lost is None:
            await self._close_session(s)
        elif lost is not None:
            await self._await_ending(self.config.timeout)   # so the new session is not a duplicate
        with self._mu:
            self._session, self._lost = None, None
            self._grants.clear()
        self._holds.clear()
        self._withdraw.clear()

    def _stop_keepalive(self) -> asyncio.Task | None:
        t, self._ka_task = self._ka_task, None
        for n in list(self._notices.values()):
            n.cancel()
        if t is not None and t is not asyncio.current_task():
            t.cancel()
            return t
        return None

    async def _close_session(self, s: Session, budget: float = 5.0) -> None:
        try:
            await self._invoke(Call.CLOSE_SESSION, self._ref,
                               deadline=self._deadline(min(self.config.timeout, budget)))
            log.info("session_closed", job=self.job_id, lease=s.lease_id)
        except E.TimesliceClientError as e:
            log.warning("session_close_failed", job=self.job_id, error=str(e),
                        hint="the lease expires by itself within its TTL")
