"""The client's state and rules; no I/O here.

``ClientCore`` holds the resolved configuration, which target is current, the
session (secret, lease) and whether it was lost, the book of grants this
client holds (grants.py), the user's hooks, and ``react``: the one place that
turns a failed attempt into "re-send", "that was success", "verify the
session" or an exception, using retry.py's decision.

Every room of the asyncio client (transport.py, session.py, revocations.py,
holds.py, workers.py, admin.py, wired together in aio.py) takes this one
``ClientCore`` in its constructor and does the I/O around it. The sync
``OrchestratorClient`` (client.py) is a face that runs that client on a private
event loop, so every rule here and there exists once.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from timeslice import errors as E
from timeslice.config import ClientConfig, node_name, valid_id
from timeslice.grants import Grants
from timeslice.logs import get_logger
from timeslice.model import Grant, Worker, node_specs
from timeslice.proto import lockd_pb2 as pb
from timeslice.retry import Action, Call, CallState, TryAgain

log = get_logger(__name__)

#: Returned by an attempt when the error proved an earlier attempt was applied.
ALREADY_APPLIED = object()
#: The most a measured peak or context may say (lockd refuses more: AcquireRequest).
MAX_MEASURED_BYTES = 1 << 50
#: Calls made on behalf of the job's session (they carry its secret).
SESSION_CALLS = frozenset({Call.KEEPALIVE, Call.ACQUIRE, Call.YIELD, Call.REGISTER_WORKER,
                           Call.UNREGISTER_WORKER})


@dataclass(frozen=True)
class SessionInfo:
    secret: str
    lease_id: int
    ttl: int
    #: monotonic, when the OpenSession attempt that opened it was sent: the lease was
    #: granted after this, so the session is alive until at least opened_at + ttl.
    #: (Not when the *call* began: an OpenSession may wait out an older session of
    #: the same job id for a whole TTL first: retry.py, OpenSession's ALREADY_EXISTS.)
    opened_at: float


class ClientCore:
    """Everything but the I/O. It runs on one event loop; ``mu`` guards what other threads read.

    The rooms read and write its state (``session``, ``lost``, ``closing``, ``closed``,
    ``cur``, ``gen``) and call its rules; nothing here calls back into a room."""

    def __init__(self, config: ClientConfig, *, release_cache: bool,
                 before_yield: Callable[[Grant], Any] | None, after_acquire: Callable[[Grant], Any] | None,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None,
                 on_grant_revoked: Callable[[E.GroupRevokedError], Any] | None):
        self.config = config
        self.release_cache = release_cache
        # Where the job's device-memory figures come from (timeslice.memstats): set by the user, or by
        # cooperate() from a memory that says them; None: torch's allocator, where the job has CUDA up.
        self.memory_stats: Any = None
        self.before_yield, self.after_acquire = before_yield, after_acquire
        self.on_session_lost = on_session_lost
        self.on_grant_revoked = on_grant_revoked
        self.pid = os.getpid()              # the process the client belongs to (see check_usable)
        self.mu = threading.RLock()
        self.cur = 0                        # index of the current target
        self.gen = 0                        # bumped on every failover
        self.session: SessionInfo | None = None
        self.lost: E.SessionLostError | None = None
        self.closed = False
        self.closing = False
        self.grants = Grants(config.job_id)
        # Numbers every Acquire attempt (AcquireRequest.attempt_seq): lockd orders a
        # job's attempts by it, so a late, stale one never replaces a newer one.
        self._seq = itertools.count(1)
        if config.job_id_generated:
            # A warning, so that it shows without any logging set-up: the job's
            # queue entries and workers carry this id.
            log.warning("job_id_generated", job=config.job_id,
                        hint="set TIMESLICE_JOB_ID or pass job_id= to choose it")

    # -- read-only state ------------------------------------------------------
    @property
    def job_id(self) -> str:
        return self.config.job_id

    @property
    def target(self) -> str:
        """The lockd address calls go to now."""
        return self.config.targets[self.cur]

    @property
    def lease_id(self) -> int | None:
        s = self.session
        return s.lease_id if s else None

    # -- targets --------------------------------------------------------------
    def failover(self, idx: int, why: str) -> None:
        """Move off target ``idx`` (no-op if another thread already did)."""
        with self.mu:
            if self.cur != idx or len(self.config.targets) == 1:
                return
            self.cur = (idx + 1) % len(self.config.targets)
            self.gen += 1
            new = self.config.targets[self.cur]
        log.info("failover", job=self.job_id, previous=self.config.targets[idx], target=new, why=why)

    # -- session state --------------------------------------------------------
    def check_usable(self, call: Call | None = None) -> None:
        if os.getpid() != self.pid:
            # A forked child shares the parent's session secret and a copy of its channels:
            # using them would act (and close the session) in the parent's name.
            raise E.ClientForkedError(f"client of job {self.job_id!r} was made in process {self.pid}, "
                                      f"not in this one ({os.getpid()})")
        if self.closed:
            raise E.ClientClosedError(f"client of job {self.job_id!r} is closed")
        if self.lost is not None and (call is None or call in SESSION_CALLS):
            raise self._lost_error()

    def _lost_error(self) -> E.SessionLostError:
        lost = self.lost
        assert lost is not None
        return E.SessionLostError(str(lost), code=lost.code, reason=lost.reason, details=lost.details)

    def take_loss(self, err: E.SessionLostError, session: SessionInfo | None) -> Callable | None:
        """Record the loss of ``session``; returns the callback to fire (once), if any."""
        with self.mu:
            if self.lost is not None or self.closing or self.closed or (session is not None and session is not self.session):
                return None
            self.lost = err
            lost_groups = self.grants.clear()
            cb = self.on_session_lost
        log.warning("session_lost", job=self.job_id, lease=self.lease_id, groups=lost_groups, reason=str(err))
        return cb

    def loss_from(self, call: Call, err: E.TimesliceClientError) -> E.SessionLostError | None:
        """The session loss an error of a session-bound call proves, if any."""
        if call not in SESSION_CALLS:
            return None
        if isinstance(err, E.SessionLostError):
            return err
        if isinstance(err, E.AuthError):
            return E.SessionLostError(f"session of job {self.job_id!r} was replaced: {err.details}",
                                      code=err.code, details=err.details)
        return None

    # -- the reaction to one failed attempt ------------------------------------
    def react(self, st: CallState, idx: int, code: str, details: str) -> object:
        """Returns ``ALREADY_APPLIED`` or ``Action.VERIFY_SESSION``; raises ``TryAgain`` or the mapped error."""
        d = st.decide(code, details)
        if d.action is not Action.RAISE:
            log.debug("attempt_failed", job=self.job_id, method=st.call.method,
                      target=self.config.targets[idx], code=code, action=d.action.value, why=d.why)
        if d.failover:
            self.failover(idx, f"{code}: {details}"[:200])
        if d.action is Action.RETRY:
            raise TryAgain(code, details)
        if d.action is Action.SUCCEED:
            return ALREADY_APPLIED
        if d.action is Action.VERIFY_SESSION:
            return Action.VERIFY_SESSION
        raise E.from_status(code, details, st.call.method)

    def exhausted(self, st: CallState, last: TryAgain) -> E.TimesliceClientError:
        """The error for a call whose re-sends ran out (deadline or failover window)."""
        note = (f" (gave up after {st.attempts} attempt(s) over {', '.join(self.config.targets)})")
        return E.from_status(last.code, last.details, st.call.method, note=note)

    # -- requests -------------------------------------------------------------
    def _next_seq(self) -> int:
        with self.mu:
            return next(self._seq)

    def acquire_req(self, group_id: str, hint: int, last_hold_ms: int = 0, priority: int = 0,
                    peak_bytes: int = 0, context_bytes: int = 0, exclusive: bool = False) -> pb.AcquireRequest:
        """One Acquire attempt: a fresh ``attempt_seq`` on every (re-)send."""
        if not isinstance(priority, int) or not 0 <= priority < 2**32:
            raise ValueError(f"priority must be a class >= 0 (lockd accepts 0..9), got {priority!r}")
        return pb.AcquireRequest(job_id=self.job_id, session_secret=self.secret(), group_id=group_id,
                                 device_bytes_hint=int(hint), attempt_seq=self._next_seq(),
                                 last_hold_ms=int(last_hold_ms), priority=priority,
                                 peak_bytes=min(int(peak_bytes), MAX_MEASURED_BYTES),
                                 context_bytes=min(int(context_bytes), MAX_MEASURED_BYTES), exclusive=bool(exclusive))

    def open_req(self, sent: list[float]) -> pb.OpenSessionRequest:
        """One OpenSession attempt; notes when it was sent (the new lease is younger)."""
        sent[:] = [time.monotonic()]
        return pb.OpenSessionRequest(job_id=self.job_id, ttl_seconds=self.config.session_ttl)

    def yield_req(self, group_id: str, token: int) -> pb.YieldRequest:
        return pb.YieldRequest(job_id=self.job_id, session_secret=self.secret(), group_id=group_id, token=token)

    def ref(self) -> pb.SessionRef:
        return pb.SessionRef(job_id=self.job_id, session_secret=self.secret())

    def secret(self) -> str:
        s = self.session
        return s.secret if s else ""

    def worker_req(self, pid: int | None, node: str | None, device_bytes: int,
                   swap: str = "", gpus=(), endpoint: str = "", tags=None,
                   collective: bool = False) -> tuple[pb.WorkerRequest, Worker]:
        """The RegisterWorker request. ``swap``/``gpus``/``endpoint``/``tags``/``collective``
        say how the node agent is to move the worker (see lockd.proto WorkerRequest)."""
        w = Worker(valid_id("node", node) if node else node_name(), int(pid or os.getpid()), int(device_bytes))
        req = pb.WorkerRequest(job_id=self.job_id, session_secret=self.secret(), node=w.node, pid=w.pid,
                               device_bytes=w.device_bytes, swap=swap, gpus=list(gpus), endpoint=endpoint,
                               tags=[pb.TagPolicy(tag=t, policy=p) for t, p in (tags or {}).items()],
                               collective=collective)
        return req, w

    @staticmethod
    def create_req(group_id: str, nodes, isolation: str = "", tenants=(), admins=()) -> pb.CreateGroupRequest:
        try:
            specs = node_specs(nodes)
        except (ValueError, TypeError) as e:
            raise E.InvalidArgumentError(str(e)) from None
        if isinstance(tenants, str) or isinstance(admins, str):
            raise E.InvalidArgumentError("tenants and admins are lists of tenant names")
        return pb.CreateGroupRequest(group_id=group_id, nodes=[n.to_pb() for n in specs], isolation=isolation,
                                     tenants=list(tenants), admins=list(admins))

    def check_held(self, group_id: str) -> Grant:
        """The grant this client holds on ``group_id``; no I/O. Raises ``SessionLostError`` if the
        session is gone, ``GroupRevokedError`` if an admin deleted the group under the hold (learnt
        from a keepalive), ``NotHolderError`` if the client does not hold it. A job may call it
        between steps of a long GPU phase."""
        self.check_usable(Call.YIELD)
        return self.grants.check(group_id)

    @staticmethod
    def deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + max(0.0, float(timeout))
