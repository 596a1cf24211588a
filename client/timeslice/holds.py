"""Holding a group: acquire (FIFO, through failover), yield, and the withdrawal of a failed acquire.

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

``Holds`` does acquire and yield; ``Withdrawals`` keeps the groups whose failed
acquire is still to be taken back and takes them back (the rules are
withdraw.py's); the keepalive retries them (session.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from timeslice import errors as E
from timeslice import memstats
from timeslice import withdraw as W
from timeslice.common import tracing
from timeslice.core import ALREADY_APPLIED, ClientCore
from timeslice.hooks import release_framework_cache
from timeslice.logs import get_logger
from timeslice.model import Grant, Released
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.retry import Call, CallState
from timeslice.session import Sessions
from timeslice.transport import MOVED, Transport
from timeslice.usercode import UserCode

log = get_logger(__name__)
_POLL = 0.2          # s; how often a blocked acquire looks at session loss / failover / close


class Withdrawals:
    """The groups whose failed acquire may have left the job's entry behind, and taking them back.

    ``release(group_id, token)``: yields a grant a withdrawing Acquire got (Holds')."""

    def __init__(self, core: ClientCore, transport: Transport, release: Callable[[str, int], Awaitable[None]]):
        self.core, self.transport = core, transport
        self._release = release
        self._groups: set[str] = set()

    def pending(self) -> bool:
        return bool(self._groups)

    def add(self, group_id: str) -> None:
        self._groups.add(group_id)

    def discard(self, group_id: str) -> None:
        """A new acquire of the group supersedes its withdrawal."""
        self._groups.discard(group_id)

    def clear(self) -> None:
        self._groups.clear()

    async def run(self, budget: float) -> None:
        """Take back the entries failed acquires may have left (see withdraw.py)."""
        for group in sorted(self._groups):
            if await self._withdraw_one(group, budget):
                self._groups.discard(group)
                log.info("acquire_withdrawn", job=self.core.job_id, group=group)

    async def _withdraw_one(self, group: str, budget: float) -> bool:
        core = self.core
        end = time.monotonic() + budget
        n = 0
        while time.monotonic() < end and not core.closed and core.lost is None:
            if group not in self._groups:
                return False                    # a new acquire of the group took over
            idx = core.cur
            try:
                r = await self.transport.stub(idx).Acquire(core.acquire_req(group, 0), timeout=W.ATTEMPT_S)
                code, details = None, ""
            except grpc.RpcError as e:
                code, details = (e.code().name if e.code() else "UNKNOWN"), e.details() or ""
            v = W.verdict(code, details)
            if v is W.Verdict.GRANTED:
                await self._release(group, r.token)   # granted to nobody: hand it straight back
                return True
            if v is W.Verdict.DONE:
                return True
            core.failover(idx, f"withdraw: {code}")
            n += 1
            await asyncio.sleep(min(max(0.0, end - time.monotonic()), 0.05 * n))
        return False


class Holds:
    """Acquire and yield, with the hooks around a hold and what lockd's profiles are sent."""

    def __init__(self, core: ClientCore, transport: Transport, user: UserCode, sessions: Sessions,
                 withdrawals: Withdrawals, report_first: Callable[[], Awaitable[None]] | None = None):
        self.core, self.transport, self.user = core, transport, user
        self.sessions, self.withdrawals = sessions, withdrawals
        self.report_first = report_first            # before a Yield: the agents' fresh reports (Workers.sync_reports)
        self._dangling: list[tuple[grpc.aio.Call, asyncio.Future]] = []
        # Per group: when our Acquire returned, and how long the last hold lasted as we saw it
        # (Acquire returned -> Yield called); sent with the next Acquire for lockd's profiles.
        self._granted_at: dict[str, tuple[int, float]] = {}
        self._last_hold_ms: dict[str, int] = {}
        # Per group: the largest allocator peak of a hold and of the memory outside the allocator, as
        # measured at each yield (timeslice.memstats); sent with every later Acquire (lockd/footprints.py).
        self._measured: dict[str, memstats.Measure] = {}

    # == acquire ======================================================================
    async def acquire(self, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0, *,
                      priority: int = 0, exclusive: bool = False) -> Grant:
        """Wait until this job holds ``group_id`` (FIFO); returns the Grant.

        timeout: seconds to wait; None waits for as long as it takes. On timeout
        the job's place in the queue is given up and AcquireTimeoutError raised.
        priority: the class, 0 (default, lowest) .. 9, on a group created with priorities
        (served by class, FIFO within a class, within the group's aging bound); a group
        without priorities refuses any but 0 (InvalidArgument).
        exclusive: this phase wants the group's GPUs alone (a measurement, a latency-critical
        phase): on a group with sharing "fit" nobody holds beside it (an exclusive group: always so).
        device_bytes_hint: the device memory the phase needs at its peak on each node; on a fit
        group it is what the grant weighs (0: unknown, so the grant weighs the whole device).
        Calling it while holding the group returns the same grant at once.
        ``after_acquire(grant)`` runs before it returns; if it raises, the group is released.
        """
        # One trace per handoff starts here when traces are on (common/tracing.py; a no-op when off).
        with tracing.span("timeslice.acquire", kind="client",
                          attributes={"timeslice.job": self.core.job_id, "timeslice.group": group_id}) as span:
            if span is not None:
                from timeslice.config import node_name
                tracing.set_attributes(span, {"timeslice.node": node_name()})
            grant = await self._acquire(group_id, timeout, device_bytes_hint, priority, exclusive)
            tracing.set_attributes(span, {"timeslice.token": grant.token, "timeslice.leader_epoch": grant.leader_epoch,
                                          "timeslice.waited_ms": grant.waited_ms, "timeslice.restored": grant.restored,
                                          "timeslice.elided": grant.elided,
                                          "timeslice.bytes_moved": grant.bytes_moved})
        return grant

    async def _acquire(self, group_id: str, timeout: float | None, device_bytes_hint: int,
                       priority: int = 0, exclusive: bool = False) -> Grant:
        core = self.core
        await self.sessions.ensure()
        deadline = core.deadline(timeout)
        self.withdrawals.discard(group_id)  # a new acquire of the group supersedes a withdrawal
        st = CallState(Call.ACQUIRE, acquire_deadline=timeout is not None)
        left: list = []                     # this call's attempts left running on replicas we moved off

        def attempt(stub, idx, req, t):
            return self._acquire_attempt(stub, idx, req, t, left)

        last_hold = self._last_hold_ms.get(group_id, 0)
        m = self._measured.get(group_id, memstats.Measure())
        try:
            reply = await self.transport.invoke(
                Call.ACQUIRE, lambda: core.acquire_req(group_id, device_bytes_hint, last_hold, priority,
                                                       m.peak_bytes, m.context_bytes, exclusive),
                deadline=deadline, cap=0, attempt=attempt, st=st)
        except E.TimesliceClientError as e:
            if W.needs_withdraw(e.code, e.details) and not core.lost and not core.closing:
                self.withdrawals.add(group_id)
                await self.withdrawals.run(W.FIRST_BUDGET_S)
            raise
        finally:
            self._drop_left(left)
        grant = Grant.from_pb(reply)
        core.grants.add(grant)
        self._last_hold_ms.pop(group_id, None)
        if self._granted_at.get(group_id, (0, 0.0))[0] != grant.token:     # a re-acquire keeps its start
            self._granted_at[group_id] = (grant.token, time.monotonic())
            stats = await self._stats()
            if stats is not None:
                await self.user.blocking(memstats.reset, stats)            # this hold's peak counts from here
        log.info("acquired", job=core.job_id, group=group_id, token=grant.token, epoch=grant.leader_epoch,
                 waited_ms=round(grant.waited_ms, 3), restored=grant.restored)
        if core.after_acquire is not None:
            try:
                await self.user.run(core.after_acquire, grant, name="after_acquire")
            except BaseException:
                await self.release_quietly(group_id, grant.token)
                raise
        return grant

    async def _acquire_attempt(self, stub: pbg.LockdStub, idx: int, req: pb.AcquireRequest, t: float | None,
                               left: list):
        core = self.core
        call = stub.Acquire(req, timeout=t, metadata=tracing.metadata())
        task = asyncio.ensure_future(call)
        gen0 = core.gen
        finished = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL)
                if done:
                    finished = True
                    return task.result()
                if core.closed or core.lost is not None:
                    core.check_usable(Call.ACQUIRE)
                if t is None and core.gen != gen0 and core.cur != idx:
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

    def close(self) -> None:
        """At close: the attempts still left running on replicas we moved off end."""
        for call, task in self._dangling:
            call.cancel()
            task.cancel()
        self._dangling.clear()

    # == yield ========================================================================
    async def yield_(self, group_id: str, token: int | None = None) -> Released:
        """Release ``group_id``. ``token`` defaults to the one this client's acquire returned.

        Runs ``before_yield(grant)``, then empties torch's CUDA cache (if
        ``release_cache``), then sends Yield. A re-sent Yield whose first
        attempt was applied counts as success (``released=True``). A grant an
        admin revoked by deleting its group raises ``GroupRevokedError``.
        """
        core = self.core
        core.check_usable(Call.YIELD)
        since = self._granted_at.pop(group_id, None)
        if since is not None:
            self._last_hold_ms[group_id] = max(1, round((time.monotonic() - since[1]) * 1000))
        tok, held = core.grants.token_for(group_id, token)
        if held is not None and core.before_yield is not None:
            await self.user.run(core.before_yield, held, name="before_yield")
        stats = await self._stats() if held is not None else None
        if stats is not None:
            # Before the cache is released: what the hold reserved, and what the process holds beside it.
            got = await self.user.blocking(memstats.measure, stats)
            old = self._measured.get(group_id, memstats.Measure())
            self._measured[group_id] = memstats.Measure(max(old.peak_bytes, got.peak_bytes),
                                                        max(old.context_bytes, got.context_bytes))
        if core.release_cache:
            await self.user.blocking(release_framework_cache)
        if self.report_first is not None:
            await self.report_first()               # what grew inside the hold is reported first
        await self.sessions.ensure()
        try:
            reply = await self.transport.invoke(Call.YIELD, lambda: core.yield_req(group_id, tok),
                                                deadline=core.deadline(core.config.timeout))
        except (E.NotHolderError, E.StaleTokenError, E.GroupRevokedError):
            core.grants.forget(group_id, tok)
            raise
        core.grants.forget(group_id, tok)
        if reply is ALREADY_APPLIED:
            out = Released(group_id, tok, True, False)
        else:
            out = Released(group_id, tok, reply.released, reply.deferred_snapshot)
        log.info("yielded", job=core.job_id, group=group_id, token=tok, deferred=out.deferred_snapshot)
        return out

    async def _stats(self):
        """The job's ``DeviceStats``: the one set (or the cooperating memory's), else torch's allocator
        where the job has CUDA up (made once, on the job's thread: its current device; never imports torch)."""
        if self.core.memory_stats is None:
            self.core.memory_stats = await self.user.blocking(memstats.default_stats)
        return self.core.memory_stats

    def measured(self, group_id: str) -> memstats.Measure:
        """What this client will send with its next Acquire of ``group_id`` (its holds' measures)."""
        return self._measured.get(group_id, memstats.Measure())

    async def release_quietly(self, group_id: str, token: int) -> None:
        """Yield ``group_id``'s ``token``; a failure is logged, not raised."""
        try:
            await self.yield_(group_id, token)
        except E.TimesliceClientError as e:
            log.warning("release_failed", job=self.core.job_id, group=group_id, token=token, error=str(e))
