"""The raw job client of benchmarks, chaos scenarios and lockd's tests: lockd's stubs and a small failover.

It speaks the generated gRPC stubs only (no client library), so what a
benchmark measures is the RPC itself and what a chaos history shows is what
lockd answered, not what a library made of it. One ``RawJob`` is one job's
session over a list of replicas, starting at ``home``:

* A short call (KeepAlive, Yield, RegisterWorker, ...) that ends UNAVAILABLE,
  DEADLINE_EXCEEDED (the replica is paused or cut off: ``rpc_timeout`` bounds
  each try) or CANCELLED (a replica shutting down cancels what still runs) is
  re-sent to the next replica, with jittered backoff (tenacity), until the
  call's deadline; then ``GiveUp``.
* Acquire is sent without a short deadline (a deadline that expires makes
  lockd give up the waiter's place). When its replica is left (the call
  failed, or the keepalive left it), it is re-sent to the next one *and the
  first call is left running*: the re-sent one finds the same queue entry
  (same token), and cancelling the first would delete it. Each send is
  numbered (``attempt_seq``): lockd lets a late, older one change nothing.
  Only the newest send's answer counts (an older one's grant included: the
  newest, still on its way, would enqueue the job again after a Yield of
  it); once it answers, the older sends are cancelled, as the library does.
* A Yield re-sent with the same token that finds the job ``not_queued``
  means the earlier one applied.
* ABORTED / UNAUTHENTICATED mean the session is gone: ``RawSessionLost``.

With ``failover=False`` (lockd's tests, which talk to one replica on
purpose) every call goes once to the one replica and its error comes back as
it is. ``Channels`` may be shared by many jobs (``per_target`` connections
each, picked by the job's ``slot``).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import tenacity

from timeslice.common.server.etcd.backoff import Backoff
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

SC = grpc.StatusCode
RETRYABLE = (SC.UNAVAILABLE, SC.DEADLINE_EXCEEDED, SC.CANCELLED)
LOST = (SC.ABORTED, SC.UNAUTHENTICATED)
#: Between re-sends: up to 20 ms doubling to 200 ms, full jitter (as timeslice.common.server.etcd.backoff), so jobs
#: do not move in step.
BACKOFF_S = (0.02, 0.2)


class GiveUp(RuntimeError):
    """No answer before the call's deadline (every replica tried)."""


class RawSessionLost(GiveUp):
    """lockd says the job's session is gone (ABORTED / UNAUTHENTICATED)."""


class Channels:
    """grpc.aio channels to lockd targets, ``per_target`` connections each (shared by jobs)."""

    def __init__(self, per_target: int = 1):
        self.per_target = per_target
        self._ch: dict[tuple[str, int], tuple[grpc.aio.Channel, pbg.LockdStub]] = {}

    def stub(self, target: str, slot: int = 0) -> pbg.LockdStub:
        key = (target, slot % self.per_target)
        got = self._ch.get(key)
        if got is None:
            ch = grpc.aio.insecure_channel(target, options=[("grpc.initial_reconnect_backoff_ms", 50),
                                                            ("grpc.max_reconnect_backoff_ms", 200)])
            got = self._ch[key] = (ch, pbg.LockdStub(ch))
        return got[1]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c, _ in self._ch.values()), return_exceptions=True)
        self._ch.clear()


class RawJob:
    """One job's session and calls, with failover over ``targets`` starting at ``home``."""

    def __init__(self, job_id: str, targets: list[str], channels: Channels | None = None, *, home: int = 0,
                 slot: int = 0, ttl: int = 0, rpc_timeout: float | None = None, failover: bool = True,
                 log: Callable[[str], None] = lambda _m: None):
        self.job_id, self.targets, self.slot, self.ttl = job_id, list(targets), slot, ttl
        self._own_channels = channels is None
        self.channels = channels or Channels()
        self.rpc_timeout, self.failover, self.log = rpc_timeout, failover, log
        self._i = home % len(self.targets)
        self.secret, self.lease = "", 0
        self.failovers = 0                          # times this job moved to the next replica
        self.resends: list[tuple[str, str]] = []    # (method, code) of each re-sent call
        self.lost: str = ""                         # why the session is gone ("" while it is not)
        self.seq = 0                                # AcquireRequest.attempt_seq of the last send
        self.answered_by = ""                       # the replica whose answer the last Acquire returned
        self._moved: asyncio.Future | None = None

    # -- replicas ------------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return self.targets[self._i]

    @property
    def stub(self) -> pbg.LockdStub:
        return self.channels.stub(self.target, self.slot)

    def leave(self, idx: int, why: str) -> None:
        """Move off replica ``idx`` (if it is still the current one); a waiting Acquire re-sends."""
        if self._i != idx:
            return
        self._i = (idx + 1) % len(self.targets)
        self.failovers += 1
        self.log(f"leave replica {self.targets[idx]} ({why}) -> {self.target}")
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)

    def ref(self) -> pb.SessionRef:
        return pb.SessionRef(job_id=self.job_id, session_secret=self.secret)

    async def call(self, method: str, req, timeout: float = 30.0, resent: list | None = None,
                   try_timeout: float | None = None):
        """One logical short call, re-sent to the next replica on a transient failure until ``timeout``;
        each try waits ``try_timeout`` (default ``rpc_timeout``); failed tries go to ``resent`` if given."""
        if not self.failover:
            return await getattr(self.stub, method)(req, timeout=timeout)
        deadline = time.monotonic() + timeout
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in RETRYABLE),
            stop=lambda _s: time.monotonic() >= deadline, reraise=False,
            wait=tenacity.wait_random_exponential(multiplier=BACKOFF_S[0], max=BACKOFF_S[1]))
        try:
            async for attempt in retrying:
                with attempt:
                    idx, left = self._i, deadline - time.monotonic()
                    per_try = try_timeout or self.rpc_timeout or left
                    try:
                        return await getattr(self.channels.stub(self.targets[idx], self.slot), method)(
                            req, timeout=min(left, per_try))
                    except grpc.aio.AioRpcError as e:
                        self._failed(idx, method, e)
                        if resent is not None and e.code() in RETRYABLE:
                            resent.append(e.code())
                        raise
        except tenacity.RetryError as e:
            raise GiveUp(f"{self.job_id}: {method} not answered within {timeout:.1f}s") \
                from e.last_attempt.exception()

    def _failed(self, idx: int, method: str, e: grpc.aio.AioRpcError) -> None:
        if e.code() in RETRYABLE:
            self.resends.append((method, e.code().name))
            self.leave(idx, f"{method}: {e.code().name}")
        elif e.code() in LOST:
            self.lost = self.lost or f"{method}: {e.code().name} {e.details()}"
            raise RawSessionLost(self.lost) from e

    # -- the session ---------------------------------------------------------------------------
    async def open(self, ttl: int | None = None, timeout: float = 30.0, patient: bool = False) -> RawJob:
        """OpenSession. It is not idempotent (ALREADY_EXISTS on a lost reply), so it is not re-sent,
        unless ``patient``: then any failure is retried until ``timeout`` (a previous session of
        this job id, or one whose reply was lost, expires within its TTL)."""
        req = pb.OpenSessionRequest(job_id=self.job_id, ttl_seconds=self.ttl if ttl is None else ttl)
        if not patient:
            r = await self.stub.OpenSession(req, timeout=timeout)
        else:
            r = await tenacity.AsyncRetrying(
                retry=tenacity.retry_if_exception_type((grpc.aio.AioRpcError, GiveUp)),
                stop=tenacity.stop_after_delay(timeout), wait=tenacity.wait_fixed(0.3) + tenacity.wait_random(0, 0.1), reraise=True,
                before_sleep=lambda s: self.log(f"open session: {s.outcome and s.outcome.exception()}"[:300]))(
                self.call, "OpenSession", req, 2 * len(self.targets) * (self.rpc_timeout or 1.0))
        self.secret, self.lease, self.lost = r.session_secret, r.lease_id, ""
        return self

    async def keepalive(self, timeout: float | None = None) -> int:
        timeout = timeout or len(self.targets) * (self.rpc_timeout or 5.0)
        return (await self.call("KeepAlive", self.ref(), timeout)).ttl_seconds

    async def keepalive_loop(self, period: float) -> None:
        """KeepAlive every ``period`` s until cancelled or the session is lost."""
        while not self.lost:
            await asyncio.sleep(period)
            try:
                await self.keepalive()
            except RawSessionLost:
                self.log(f"session lost: {self.lost}")
            except (grpc.aio.AioRpcError, GiveUp) as e:
                self.log(f"keepalive: {e}"[:300])
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)            # wake a waiting Acquire: it raises RawSessionLost

    async def close_session(self, timeout: float = 5.0) -> None:
        """CloseSession (the session's keys go at once); a failure is only logged."""
        try:
            await self.call("CloseSession", self.ref(), timeout)
        except (grpc.aio.AioRpcError, GiveUp) as e:
            self.log(f"close session: {e}"[:300])

    async def close(self) -> None:
        """Close the channels, if this job made them (shared ones are their owner's to close)."""
        if self._own_channels:
            await self.channels.close()

    # -- the lock ------------------------------------------------------------------------------
    async def acquire(self, group: str, timeout: float = 60.0, hint: int = 0, priority: int = 0,
                      exclusive: bool = False) -> pb.AcquireReply:
        req = pb.AcquireRequest(job_id=self.job_id, session_secret=self.secret, group_id=group,
                                device_bytes_hint=hint, priority=priority, exclusive=exclusive)
        if not self.failover:
            self.answered_by = self.target
            return await self.stub.Acquire(req, timeout=timeout)
        deadline = time.monotonic() + timeout
        calls: dict[asyncio.Future, int] = {}
        newest: asyncio.Future | None = None       # the last send: the only one whose answer counts
        backoff = Backoff(*BACKOFF_S)
        try:
            while True:
                if self.lost:
                    raise RawSessionLost(self.lost)
                if newest not in calls or calls[newest] != self._i:
                    # Send (again) to the current replica; earlier sends stay running.
                    idx, self.seq = self._i, self.seq + 1
                    req.attempt_seq = self.seq
                    if calls:
                        self.resends.append(("Acquire", "moved"))
                    newest = asyncio.ensure_future(self.channels.stub(self.targets[idx], self.slot).Acquire(
                        req, timeout=deadline - time.monotonic() + 30))
                    newest.add_done_callback(lambda f: f.cancelled() or f.exception())   # read, never lost
                    calls[newest] = idx
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GiveUp(f"{self.job_id}: Acquire not granted within {timeout:.1f}s")
                self._moved = asyncio.get_running_loop().create_future()
                done, _ = await asyncio.wait([*calls, self._moved], timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                for call in [c for c in done if c in calls]:
                    idx = calls.pop(call)
                    if call is not newest:
                        # An older attempt's answer does not count, a grant included: lockd orders attempts
                        # by number, so the newest one, still on its way, owns the entry. Returning the older
                        # grant and yielding it would let the newest enqueue the job again when it lands:
                        # granted to nobody (the fit netns chaos scenario saw that ghost).
                        continue
                    try:
                        reply = call.result()
                    except grpc.aio.AioRpcError as e:
                        self._failed(idx, "Acquire", e)
                        if e.code() not in RETRYABLE:
                            raise
                        await asyncio.sleep(backoff.next())
                        continue
                    self.answered_by = self.targets[idx]
                    for older in calls:
                        older.cancel()      # their replicas withdraw them: they own nothing the newest took over
                    return reply
        except BaseException:
            # The attempt failed: withdraw every copy of it.
            for call in calls:
                call.cancel()
            raise
        finally:
            self._moved = None

    async def yield_(self, group: str, token: int, timeout: float = 30.0) -> pb.YieldReply:
        """Release. A re-sent Yield that finds the job no longer queued: the first one applied
        (``released`` False: not this call). A try waits twice ``rpc_timeout``: the release is a write."""
        req = pb.YieldRequest(job_id=self.job_id, session_secret=self.secret, group_id=group, token=token)
        resent: list = []
        try:
            return await self.call("Yield", req, timeout, resent, 2 * self.rpc_timeout if self.rpc_timeout else None)
        except grpc.aio.AioRpcError as e:
            if (resent and e.code() == SC.FAILED_PRECONDITION
                    and "not_queued" in (e.details() or "")):
                return pb.YieldReply(released=False)
            raise
