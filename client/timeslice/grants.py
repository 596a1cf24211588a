"""The grants one client holds, and those an admin revoked under it. Sans-IO.

``Grants`` is the client's book of holds: acquire adds a grant, yield takes it
out, a session loss clears the book. It also carries the rule for revoked
groups (lockd/revocations.py): a KeepAlive reply lists the groups an admin
deleted while this job was queued on them, until the job's Yield of the deleted
entry's token acknowledges the notice. The list carries names, not tokens, and
a notice stays listed until acknowledged; so a listed group is only a
*suspect*: the driver reads the group's status, and the grant is dropped only
if the group's head is no longer this very grant (a notice left from an
earlier wait must not end a newer grant on the re-created group). A dropped
grant is remembered, so the next yield or hold check of it raises
``GroupRevokedError`` (once) instead of a bare "not holder".

Read from any thread (the sync face reads ``held``), written on the client's loop.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

from timeslice import errors as E
from timeslice.logs import get_logger
from timeslice.model import Grant

log = get_logger(__name__)


class Grants:
    def __init__(self, job_id: str):
        self.job_id = job_id
        self._mu = threading.Lock()
        self._held: dict[str, Grant] = {}
        self._revoked: dict[str, Grant] = {}    # ended by an admin's delete, not yet told by a call

    # -- the book -------------------------------------------------------------
    def snapshot(self) -> dict[str, Grant]:
        with self._mu:
            return dict(self._held)

    def get(self, group_id: str) -> Grant | None:
        return self._held.get(group_id)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._held

    def add(self, grant: Grant) -> None:
        with self._mu:
            self._held[grant.group_id] = grant
            self._revoked.pop(grant.group_id, None)   # a new grant supersedes an old revocation

    def forget(self, group_id: str, token: int) -> None:
        with self._mu:
            g = self._held.get(group_id)
            if g is not None and g.token == token:
                del self._held[group_id]

    def clear(self) -> list[str]:
        """Drop everything (the session ended); the groups that were held."""
        with self._mu:
            groups = sorted(self._held)
            self._held.clear()
            self._revoked.clear()
            return groups

    # -- what a call needs ------------------------------------------------------
    def check(self, group_id: str) -> Grant:
        """The grant held on ``group_id``; GroupRevokedError or NotHolderError if there is none."""
        with self._mu:
            held = self._held.get(group_id)
            if held is None and group_id in self._revoked:
                raise self.revoked_error(self._revoked[group_id])
        if held is None:
            raise self._not_holder(group_id)
        return held

    def token_for(self, group_id: str, token: int | None) -> tuple[int, Grant | None]:
        """The token a yield of ``group_id`` carries (``token``, else the held grant's) and the
        grant it releases, if this client holds it; a revoked grant raises, once."""
        with self._mu:
            revoked = self._revoked.get(group_id)
            if revoked is not None and token in (None, revoked.token):
                del self._revoked[group_id]             # told once, by this call's error
                raise self.revoked_error(revoked)
            held = self._held.get(group_id)
        if token is None:
            if held is None:
                raise self._not_holder(group_id)
            return held.token, held
        return int(token), held if held is not None and held.token == token else None

    def ends_in_error(self, group_id: str) -> bool:
        """Whether leaving a scope of ``group_id`` must raise (its grant was revoked)."""
        return group_id in self._revoked

    # -- revocations ------------------------------------------------------------------
    def suspects(self, groups: Iterable[str]) -> list[Grant]:
        """The grants held on groups a KeepAlive reply listed as deleted."""
        with self._mu:
            return [self._held[g] for g in groups if g in self._held]

    def still_holds(self, grant: Grant, head_job: str | None, head_token: int | None) -> bool:
        """Whether the group's head (None: no group, or an empty queue) is this very grant."""
        return head_job == self.job_id and head_token == grant.token

    def revoke(self, grant: Grant) -> E.GroupRevokedError | None:
        """Drop ``grant`` (if still held) and remember it; the error to tell the user, or None."""
        with self._mu:
            if self._held.get(grant.group_id) != grant:
                return None                             # yielded, or lost, meanwhile
            del self._held[grant.group_id]
            self._revoked[grant.group_id] = grant
        log.warning("grant_revoked", job=self.job_id, group=grant.group_id, token=grant.token)
        return self.revoked_error(grant)

    def revoked_error(self, grant: Grant) -> E.GroupRevokedError:
        return E.GroupRevokedError(
            f"group_deleted: an admin deleted group {grant.group_id!r} while job {self.job_id!r} held it "
            f"(token {grant.token})", code="ABORTED", reason="group_deleted", grant=grant)

    def _not_holder(self, group_id: str) -> E.NotHolderError:
        return E.NotHolderError(f"not_holder: job {self.job_id!r} holds no grant of {group_id!r} in this client",
                                reason="not_holder")
