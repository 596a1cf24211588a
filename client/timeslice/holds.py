"""Holding a group: acquire (FIFO, through failover), yield, withdrawal of a failed acquire, scopes.

Failover. The client keeps one channel per target and sends to the current
one; an UNAVAILABLE (or an attempt deadline) moves it to the next and the call
is re-sent if it is idempotent (see retry.py for the rules). HTTP/2 keepalive
pings (config.KEEPALIVE_TIME_MS) turn a stopped replica into an UNAVAILABLE
within ~2 s, as a killed one is. A blocked ``acquire(timeout=None)`` also moves
when another call (the keepalive) finds its replica dead, and re-sends on the
next one, leaving the first call running until the acquire ends rather than
cancelling it at once: a cancelled Acquire makes lockd give up the job's queue
entry, which the re-sent Acquire may not have found yet. Every attempt carries
a fresh ``attempt_seq``: lockd never lets an older attempt, processed late by a
replica that was stalled, replace a newer one or enqueue the job again.

An acquire that is cancelled (a task cancelled; Ctrl-C or a timeout in a sync
caller) cancels its call, and lockd gives up the job's place. One that fails
without proof that lockd dropped its entry is withdrawn (withdraw.py).
"""
from __future__ import annotations

import asyncio
import time

import grpc

from timeslice import errors as E
from timeslice import tracing
from timeslice import withdraw as W
from timeslice.core import ALREADY_APPLIED
from timeslice.hooks import release_framework_cache
from timeslice.logs import get_logger
from timeslice.model import Grant, Released
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.retry import Call, CallState
from timeslice.scope import AcceleratorScope
from timeslice.session import Sessions
from timeslice.transport import MOVED

log = get_logger(__name__)
_POLL = 0.2          # s; how often a blocked acquire looks at session loss / failover / close


class _Hold:
    """Scope bookkeeping for one group: how many scopes are inside, guarded by a mutex."""

    def __init__(self) -> None:
        self.mutex = asyncio.Lock()
        self.depth = 0


class Holds(Sessions):
    def _init_holds(self) -> None:
        self._dangling: list[tuple[grpc.aio.Call, asyncio.Future]] = []
        # Per group: when our Acquire returned, and how long the last hold lasted as we saw it
        # (Acquire returned -> Yield called); sent with the next Acquire for lockd's profiles.
        self._granted_at: dict[str, tuple[int, float]] = {}
        self._last_hold_ms: dict[str, int] = {}

    # == acquire ======================================================================
    async def acquire(self, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0, *,
                      priority: int = 0) -> Grant:
        """Wait until this job holds ``group_id`` (FIFO); returns the Grant.

        timeout: seconds to wait; None waits for as long as it takes. On timeout
        the job's place in the queue is given up and AcquireTimeoutError raised.
        priority: the class, 0 (default, lowest) .. 9, on a group created with priorities
        (served by class, FIFO within a class, within the group's aging bound); a group
        without priorities refuses any but 0 (InvalidArgument).
        Calling it while holding the group returns the same grant at once.
        ``after_acquire(grant)`` runs before it returns; if it raises, the group is released.
        """
        # One trace per handoff starts here when traces are on (timeslice/tracing.py; a no-op when off).
        with tracing.span("timeslice.acquire", kind="client",
                          attributes={"timeslice.job": self.job_id, "timeslice.group": group_id}) as span:
            if span is not None:
                from timeslice.config import node_name
                tracing.set_attributes(span, {"timeslice.node": node_name()})
            grant = await self._acquire(group_id, timeout, device_bytes_hint, priority)
            tracing.set_attributes(span, {"timeslice.token": grant.token, "timeslice.leader_epoch": grant.leader_epoch,
                                          "timeslice.waited_ms": grant.waited_ms, "timeslice.restored": grant.restored,
                                          "timeslice.elided": grant.elided,
                                          "timeslice.bytes_moved": grant.bytes_moved})
        return grant

    async def _acquire(self, group_id: str, timeout: float | None, device_bytes_hint: int,
                       priority: int = 0) -> Grant:
        await self._ensure_session()
        deadline = self._deadline(timeout)
        self._withdraw.discard(group_id)    # a new acquire of the group supersedes a withdrawal
        st = CallState(Call.ACQUIRE, acquire_deadline=timeout is not None)
        left: list = []                     # this call's attempts left running on replicas we moved off

        def attempt(stub, idx, req, t):
            return self._acquire_attempt(stub, idx, req, t, left)

        last_hold = self._last_hold_ms.get(group_id, 0)
        try:
            reply = await self._invoke(Call.ACQUIRE, lambda: self._acquire_req(group_id, device_bytes_hint, last_hold,
                                                                                  priority),
                                       deadline=deadline, cap=0, attempt=attempt, st=st)
        except E.TimesliceClientError as e:
            if W.needs_withdraw(e.code, e.details) and not self._lost and not self._closing:
                self._withdraw.add(group_id)
                await self._withdraw_pending(W.FIRST_BUDGET_S)
            raise
        finally:
            self._drop_left(left)
        grant = Grant.from_pb(reply)
        self._grants.add(grant)
        self._last_hold_ms.pop(group_id, None)
        if self._granted_at.get(group_id, (0, 0.0))[0] != grant.token:     # a re-acquire keeps its start
            self._granted_at[group_id] = (grant.token, time.monotonic())
        log.info("acquired", job=self.job_id, group=group_id, token=grant.token, epoch=grant.leader_epoch,
                 waited_ms=round(grant.waited_ms, 3), restored=grant.restored)
        if self.after_acquire is not None:
            try:
                await self._user(self.after_acquire, grant, name="after_acquire")
            except BaseException:
                await self._release_quietly(group_id, grant.token)
                raise
        return grant

    async def _acquire_attempt(self, stub: pbg.LockdStub, idx: int, req: pb.AcquireRequest, t: float | None,
                               left: list):
        call = stub.Acquire(req, timeout=t, metadata=tracing.metadata())
        task = asyncio.ensure_future(call)
        gen0 = self._gen
        finished = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL)
                if done:
                    finished = True
                    return task.result()
                if self._closed or self._lost is not None:
                    self._check_usable(Call.ACQUIRE)
                if t is None and self._gen != gen0 and self._cur != idx:
                    self._dangling.append((call, task))    # keep it alive: see the module doc
                    left.append((call, task))
                    finished = True
                    return MOVED
        finally:
            if not finished:
                call.cancel()                               # our caller gave up (or the session is gone)
                task.cancel()

    def _drop_left(self, left: list) -> None:
        """The call is over: its older attempts are of no use any more. Cancelling one makes
        its replica withdraw it, which changes nothing once a newer attempt took the entry
        over (lockd removes only what the attempt still owns)."""
        for item in left:
            call, task = item
            call.cancel()
            task.cancel()
            if item in self._dangling:
                self._dangling.remove(item)
        left.clear()

    async def _withdraw_pending(self, budget: float) -> None:
        """Take back the entries failed acquires may have left (see withdraw.py)."""
        for group in sorted(self._withdraw):
            if await self._withdraw_one(group, budget):
                self._withdraw.discard(group)
                log.info("acquire_withdrawn", job=self.job_id, group=group)

    async def _withdraw_one(self, group: str, budget: float) -> bool:
        end = time.monotonic() + budget
        n = 0
        while time.monotonic() < end and not self._closed and self._lost is None:
            if group not in self._withdraw:
                return False                    # a new acquire of the group took over
            idx = self._cur
            try:
                r = await self._stub(idx).Acquire(self._acquire_req(group, 0), timeout=W.ATTEMPT_S)
                code, details = None, ""
            except grpc.RpcError as e:
                code, details = (e.code().name if e.code() else "UNKNOWN"), e.details() or ""
            v = W.verdict(code, details)
            if v is W.Verdict.GRANTED:
                await self._release_quietly(group, r.token)   # granted to nobody: hand it straight back
                return True
            if v is W.Verdict.DONE:
                return True
            self._failover(idx, f"withdraw: {code}")
            n += 1
            await asyncio.sleep(min(max(0.0, end - time.monotonic()), 0.05 * n))
        return False

    # == yield ========================================================================
    async def yield_(self, group_id: str, token: int | None = None) -> Released:
        """Release ``group_id``. ``token`` defaults to the one this client's acquire returned.

        Runs ``before_yield(grant)``, then empties torch's CUDA cache (if
        ``release_cache``), then sends Yield. A re-sent Yield whose first
        attempt was applied counts as success (``released=True``). A grant an
        admin revoked by deleting its group raises ``GroupRevokedError``.
        """
        self._check_usable(Call.YIELD)
        since = self._granted_at.pop(group_id, None)
        if since is not None:
            self._last_hold_ms[group_id] = max(1, round((time.monotonic() - since[1]) * 1000))
        tok, held = self._grants.token_for(group_id, token)
        if held is not None and self.before_yield is not None:
            await self._user(self.before_yield, held, name="before_yield")
        if self.release_cache:
            await self._blocking(release_framework_cache)
        await self._ensure_session()
        try:
            reply = await self._invoke(Call.YIELD, lambda: self._yield_req(group_id, tok),
                                       deadline=self._deadline(self.config.timeout))
        except (E.NotHolderError, E.StaleTokenError, E.GroupRevokedError):
            self._grants.forget(group_id, tok)
            raise
        self._grants.forget(group_id, tok)
        if reply is ALREADY_APPLIED:
            out = Released(group_id, tok, True, False)
        else:
            out = Released(group_id, tok, reply.released, reply.deferred_snapshot)
        log.info("yielded", job=self.job_id, group=group_id, token=tok, deferred=out.deferred_snapshot)
        return out

    release = yield_

    async def _release_quietly(self, group_id: str, token: int) -> None:
        try:
            await self.yield_(group_id, token)
        except E.TimesliceClientError as e:
            log.warning("release_failed", job=self.job_id, group=group_id, token=token, error=str(e))

    # == scopes =======================================================================
    def on_accelerators(self, group_id: str, *, timeout: float | None = None,
                        device_bytes_hint: int = 0) -> AcceleratorScope:
        """Decorator / context manager: hold ``group_id`` while the body runs (see scope.py)."""
        return AcceleratorScope(self, group_id, timeout, device_bytes_hint)

    def _scope_enter(self, group_id: str, timeout, hint):
        raise TypeError("AsyncOrchestratorClient.on_accelerators is an async context manager: "
                        "use `async with`, or the sync OrchestratorClient")

    def _scope_exit(self, group_id: str):
        raise TypeError("use `async with` with AsyncOrchestratorClient")

    async def _scope_enter_async(self, group_id: str, timeout: float | None, hint: int) -> Grant:
        hold = self._holds.setdefault(group_id, _Hold())
        async with hold.mutex:
            if hold.depth == 0 or group_id not in self._grants:
                await self.acquire(group_id, timeout, hint)
                hold.depth = 0
            hold.depth += 1
            return self._grants.check(group_id)

    async def _scope_exit_async(self, group_id: str) -> None:
        hold = self._holds.setdefault(group_id, _Hold())
        async with hold.mutex:
            hold.depth = max(0, hold.depth - 1)
            if hold.depth == 0:
                self._check_usable(Call.YIELD)
                if group_id in self._grants or self._grants.ends_in_error(group_id):
                    await self.yield_(group_id)         # a revoked hold raises GroupRevokedError
