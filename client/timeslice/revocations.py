"""Groups an admin deleted under a hold, as the job's keepalives hear of them.

A KeepAlive reply lists the groups an admin deleted under the job
(``revoked_groups``, see lockd/revocations.py and grants.py): a grant held on one
is confirmed gone with a status read, dropped, acknowledged to lockd, and
reported through ``on_grant_revoked`` and a ``grant_revoked`` log event, within
one keepalive period of the deletion. The rule (what is a suspect, when a grant
is really gone) is the sans-IO ``Grants`` book's; this room does the reads.
"""
from __future__ import annotations

import asyncio

from timeslice import errors as E
from timeslice.core import ClientCore
from timeslice.logs import get_logger
from timeslice.model import Grant, GroupStatus
from timeslice.proto import lockd_pb2 as pb
from timeslice.retry import Call
from timeslice.transport import Transport
from timeslice.usercode import CALLER, UserCode

log = get_logger(__name__)


class Revocations:
    """Looks into each revoked group a keepalive names, off the keepalive's path."""

    def __init__(self, core: ClientCore, transport: Transport, user: UserCode):
        self.core, self.transport, self.user = core, transport, user
        self._notices: dict[tuple[str, int], asyncio.Task] = {}   # revocations being looked into

    def heard(self, reply) -> None:
        """Look into a KeepAlive reply's revoked groups (off the keepalive's path: a slow status
        read or user callback must never delay the next renewal)."""
        for grant in self.core.grants.suspects(getattr(reply, "revoked_groups", ())):
            key = (grant.group_id, grant.token)
            if key not in self._notices:
                t = asyncio.create_task(self._check(grant), name=f"timeslice-revoked-{grant.group_id}")
                self._notices[key] = t
                t.add_done_callback(self._notice_done)

    def stop(self) -> None:
        """Cancel the checks in flight (the keepalive stops: the session ends or is reset)."""
        for n in list(self._notices.values()):
            n.cancel()

    def _notice_done(self, task: asyncio.Task) -> None:
        for key, t in list(self._notices.items()):
            if t is task:
                del self._notices[key]

    async def _check(self, grant: Grant) -> None:
        CALLER.set(None)
        core = self.core
        try:
            st = await self.transport.invoke(Call.GROUP_STATUS, lambda: pb.GroupRef(group_id=grant.group_id),
                                             deadline=core.deadline(core.config.timeout))
            status = GroupStatus.from_pb(st)
            head = status.holder
            if core.grants.still_holds(grant, head.job_id if head else None, head.token if head else None):
                return                                  # a notice left from an earlier wait on the group
        except E.UnknownGroupError:
            pass                                        # deleted and not re-created
        except E.TimesliceClientError as e:
            log.warning("revocation_check_failed", job=core.job_id, group=grant.group_id, error=str(e))
            return                                      # the next keepalive lists it again
        err = core.grants.revoke(grant)
        if err is None:
            return                                      # yielded (or lost) meanwhile
        await self._acknowledge(grant)
        await self.user.fire(core.on_grant_revoked, err, "on_grant_revoked")

    async def _acknowledge(self, grant: Grant) -> None:
        """A Yield of the deleted hold's token: lockd answers group_deleted and drops its notice,
        so later keepalives stop listing the group (a later grant on a re-created group must
        not look revoked)."""
        core = self.core
        try:
            await self.transport.invoke(Call.YIELD, lambda: core.yield_req(grant.group_id, grant.token),
                                        deadline=core.deadline(core.config.timeout))
        except (E.GroupRevokedError, E.NotHolderError, E.StaleTokenError, E.UnknownGroupError):
            pass                                        # acknowledged, or nothing left to acknowledge
        except E.TimesliceClientError as e:
            log.warning("revocation_ack_failed", job=core.job_id, group=grant.group_id, error=str(e))
