"""The job's session: opened lazily, kept alive, surfaced when lost, and what its keepalives report.

The session is opened by the first call that needs it (acquire, yield,
register_worker), not by the constructor: a client can be made at import time,
before lockd is up, and admin-only users (the CLI) never open one. Once open,
a task renews it every TTL/3 with KeepAlive. The session is lost only when etcd
says so: lockd answers ABORTED (the lease expired or was revoked) or the
session was replaced. Then every later session call raises ``SessionLostError``
and ``on_session_lost(error)`` fires once; the client refuses session calls
until ``reset_session()``.

A keepalive that gets no answer (lockd or etcd out of reach, etcd without a
majority) proves nothing about the lease: etcd does not expire leases while it
has no raft leader and gives every lease its whole TTL again when it has one.
So past a whole TTL without a renewal the session is only *in doubt* (logged
``session_in_doubt``, ``session_in_doubt`` on the client): the keepalive goes
on trying, and the first answer settles it, kept (``session_kept``) or lost.
The client never ends the session itself on a guess: a lease etcd kept stays
the job's, with its place in each queue and its grants.

A KeepAlive reply also lists the groups an admin deleted under the job: the
keepalive hands it to revocations.py. After each renewal that succeeds, the
keepalive retries the withdrawals still pending (holds.py, withdraw.py).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from timeslice import errors as E
from timeslice.core import ClientCore, SessionInfo
from timeslice.logs import get_logger
from timeslice.retry import Call
from timeslice.revocations import Revocations
from timeslice.transport import Transport
from timeslice.usercode import CALLER, UserCode

if TYPE_CHECKING:
    from timeslice.holds import Withdrawals

log = get_logger(__name__)

class Sessions:
    """Open, keep alive, verify, reset and close the job's session."""

    def __init__(self, core: ClientCore, transport: Transport, user: UserCode, revocations: Revocations,
                 withdrawals: Withdrawals):
        self.core, self.transport, self.user = core, transport, user
        self.revocations, self.withdrawals = revocations, withdrawals
        self._open_mu: asyncio.Lock | None = None      # made on the loop, at first use
        self._ka_task: asyncio.Task | None = None
        self.in_doubt = False       # no keepalive answered for a TTL: etcd alone can say whether it lives

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
                # Re-sent (retry.py) for one keepalive period at least, and until the lease could run
                # out at the soonest: then the next round starts at once.
                reply = await self.transport.invoke(Call.KEEPALIVE, core.ref,
                                                    deadline=max(last_ok + s.ttl, t0 + cfg.keepalive_period),
                                                    cap=cfg.keepalive_attempt_timeout)
                last_ok = t0
                if self.in_doubt:
                    self.in_doubt = False
                    log.info("session_kept", job=core.job_id, lease=s.lease_id,
                             hint="etcd kept the lease through the outage: the job keeps its places and grants")
                self.revocations.heard(reply)
                if self.withdrawals.pending():
                    await self.withdrawals.run(cfg.keepalive_period / 2)
            except (E.SessionLostError, E.AuthError, E.ClientClosedError):
                return                                  # etcd's word (invoke recorded the loss), or closed
            except E.TimesliceClientError as e:
                if not self.in_doubt and time.monotonic() - last_ok >= s.ttl:
                    self.in_doubt = True
                    log.warning("session_in_doubt", job=core.job_id, lease=s.lease_id, ttl=s.ttl, error=str(e)[:200],
                                hint="no keepalive answered for a TTL; etcd may still hold the lease (it keeps "
                                     "leases while it has no majority): still trying, the first answer settles it")
                else:
                    log.warning("keepalive_failed", job=core.job_id, error=str(e))

    async def verify(self) -> None:
        """One KeepAlive: raises SessionLostError if the session is really gone."""
        core = self.core
        reply = await self.transport.invoke(Call.KEEPALIVE, core.ref, deadline=core.deadline(core.config.timeout),
                                            cap=core.config.keepalive_attempt_timeout)
        self.revocations.heard(reply)

    # -- reset and close -------------------------------------------------------------
    async def reset(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        core = self.core
        s, lost = core.session, core.lost
        self.stop_keepalive()
        if s is not None and lost is None:
            await self._close_session(s)
        self.in_doubt = False
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
        """At close: close a live session (a lost one is gone already: etcd said so)."""
        core = self.core
        s = core.session
        if s is not None and core.lost is None:
            await self._close_session(s, budget)

    async def _close_session(self, s: SessionInfo, budget: float = 5.0) -> None:
        core = self.core
        try:
            await self.transport.invoke(Call.CLOSE_SESSION, core.ref,
                                        deadline=core.deadline(min(core.config.timeout, budget)))
            log.info("session_closed", job=core.job_id, lease=s.lease_id)
        except E.TimesliceClientError as e:
            log.warning("session_close_failed", job=core.job_id, error=str(e),
                        hint="the lease expires by itself within its TTL")
