"""The asyncio client: ``AsyncOrchestratorClient``, the twin of client.py.

Same constructor, same methods, awaited:

    async with AsyncOrchestratorClient(job_id="job-1") as orchestrator:
        grant = await orchestrator.acquire("trainer-group")
        ...
        await orchestrator.yield_("trainer-group")

        @orchestrator.on_accelerators(group_id="sampler-group")
        async def generate(prompts): ...

The session is opened lazily and kept alive by an asyncio task (every TTL/3)
on the loop that opened it; the retry rules are retry.py's, shared with the
sync client. Hooks and ``on_session_lost`` may be plain functions or
coroutine functions. Channels are created on first use, inside the running
loop; use one client per event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import tenacity
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

from timeslice import errors as E
from timeslice import withdraw as W
from timeslice.auth import metadata_for
from timeslice.config import CHANNEL_OPTIONS, DEFAULT_TIMEOUT, DEFAULT_TTL
from timeslice.core import ALREADY_APPLIED, ClientCore, Session
from timeslice.hooks import release_framework_cache
from timeslice.logs import get_logger
from timeslice.model import Grant, Group, GroupStatus, JobInfo, Released, Worker
from timeslice.retry import (
    Action,
    Call,
    CallState,
    RetryPolicy,
    TryAgain,
    attempt_timeout,
    retry_on_try_again,
)
from timeslice.scope import AcceleratorScope

log = get_logger("timeslice.client")
_POLL = 0.2
_MOVED = object()


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _AsyncHold:
    def __init__(self) -> None:
        self.mutex = asyncio.Lock()
        self.depth = 0


class AsyncOrchestratorClient(ClientCore):
    """Acquire and yield GPU groups on behalf of one job, from asyncio code."""

    is_async = True

    def __init__(self, target: str | Sequence[str] | None = None, job_id: str | None = None, *,
                 session_ttl: int = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None = None,
                 release_cache: bool = True, before_yield: Callable[[Grant], Any] | None = None,
                 after_acquire: Callable[[Grant], Any] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: RetryPolicy | None = None):
        """Arguments as OrchestratorClient's."""
        super().__init__(target, job_id, session_ttl=session_ttl, timeout=timeout,
                         on_session_lost=on_session_lost, release_cache=release_cache,
                         before_yield=before_yield, after_acquire=after_acquire,
                         credentials=credentials, retry=retry)
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pbg.LockdStub] = {}
        self._open_mu: asyncio.Lock | None = None
        self._ka_task: asyncio.Task | None = None
        self._holds: dict[str, _AsyncHold] = {}
        self._dangling: list[tuple[Any, asyncio.Future]] = []
        self._withdraw: set[str] = set()            # groups whose failed acquire is still to take back

    # == plumbing ==================================================================
    def _stub(self, idx: int) -> pbg.LockdStub:
        stub = self._stubs.get(idx)
        if stub is None:
            t = self.config.targets[idx]
            ch = (grpc.aio.secure_channel(t, self._credentials, options=CHANNEL_OPTIONS) if self._credentials
                  else grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS))
            self._channels[idx], stub = ch, pbg.LockdStub(ch)
            self._stubs[idx] = stub
        return stub

    async def _invoke(self, call: Call, build: Callable[[], Any], *, deadline: float | None,
                      cap: float | None = None, attempt: Callable | None = None, st: CallState | None = None):
        st = st or CallState(call)
        cap = self.config.retry.attempt_timeout if cap is None else cap
        session = self._session

        async def once():
            self._check_usable(call)
            idx = self._cur
            stub = self._stub(idx)
            t = attempt_timeout(deadline, cap if cap > 0 else None)
            try:
                if attempt is not None:
                    got = await attempt(stub, idx, build(), t)
                    if got is _MOVED:
                        raise TryAgain("UNAVAILABLE", "moved to another replica")
                    return got
                return await getattr(stub, call.method)(build(), timeout=t, metadata=metadata_for(call.method))
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                out = self.react(st, idx, code, e.details() or "")
                if out is Action.VERIFY_SESSION:
                    await self._verify_session()
                    raise TryAgain(code, e.details() or "") from None
                return out

        retrying = tenacity.AsyncRetrying(wait=self.config.retry.wait(), stop=self.config.retry.stop(deadline),
                                          retry=retry_on_try_again(), reraise=True)
        try:
            return await retrying(once)
        except TryAgain as last:
            err = self.exhausted(st, last)
        except E.TimesliceClientError as e:
            err = e
        await self._note_loss(call, err, session)
        raise err

    async def _note_loss(self, call: Call, err: E.TimesliceClientError, session: Session | None) -> None:
        lost = self._loss_from(call, err)
        if lost is not None:
            await self._fire(self._take_loss(lost, session), lost)

    async def _fire(self, cb: Callable | None, err: E.SessionLostError) -> None:
        if cb is None:
            return
        try:
            await _maybe_await(cb(err))
        except Exception:
            log.exception("session_lost_callback_failed", job=self.job_id)

    # == session ===================================================================
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
            reply = await self._invoke(Call.OPEN_SESSION, lambda: self._open_req(sent),
                                       deadline=t0 + cfg.timeout + cfg.session_ttl)
            s = Session(reply.session_secret, reply.lease_id, reply.ttl_seconds or cfg.session_ttl, sent[0])
            self._session = s
            log.info("session_opened", job=self.job_id, lease=s.lease_id, ttl=s.ttl, target=self.target)
            self._ka_task = asyncio.create_task(self._keepalive_loop(s), name=f"timeslice-keepalive-{self.job_id}")
            return s

    async def open_session(self) -> int:
        return (await self._ensure_session()).lease_id

    async def _keepalive_loop(self, s: Session) -> None:
        cfg = self.config
        last_ok = s.opened_at
        while True:
            await asyncio.sleep(cfg.keepalive_period)
            if self._session is not s or self._closed or self._closing:
                return
            t0 = time.monotonic()
            try:
                await self._invoke(Call.KEEPALIVE, self._ref, deadline=last_ok + s.ttl,
                                   cap=cfg.keepalive_attempt_timeout)
                last_ok = t0
                if self._withdraw:
                    await self._withdraw_pending(cfg.keepalive_period / 2)
            except (E.SessionLostError, E.AuthError, E.ClientClosedError):
                return
            except E.TimesliceClientError as e:
                if time.monotonic() - last_ok >= s.ttl:
                    lost = E.SessionLostError(
                        f"no keepalive of job {self.job_id!r} succeeded for {s.ttl}s (last error: {e}); "
                        "its lease has expired")
                    await self._fire(self._take_loss(lost, s), lost)
                    return
                log.warning("keepalive_failed", job=self.job_id, error=str(e))

    async def _verify_session(self) -> None:
        await self._invoke(Call.KEEPALIVE, self._ref, deadline=self._deadline(self.config.timeout),
                           cap=self.config.keepalive_attempt_timeout)

    async def reset_session(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        s, lost = self._session, self._lost
        self._stop_keepalive()
        if s is not None and lost is None:
            await self._close_session(s)
        with self._mu:
            self._session, self._lost = None, None
            self._held.clear()
        self._holds.clear()

    def _stop_keepalive(self) -> asyncio.Task | None:
        t, self._ka_task = self._ka_task, None
        if t is not None and t is not asyncio.current_task():
            t.cancel()
            return t
        return None

    async def _close_session(self, s: Session) -> None:
        try:
            await self._invoke(Call.CLOSE_SESSION, self._ref, deadline=self._deadline(min(self.config.timeout, 5.0)))
            log.info("session_closed", job=self.job_id, lease=s.lease_id)
        except E.TimesliceClientError as e:
            log.warning("session_close_failed", job=self.job_id, error=str(e),
                        hint="the lease expires by itself within its TTL")

    # == acquire / yield =============================================================
    async def acquire(self, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0) -> Grant:
        """Wait until this job holds ``group_id`` (FIFO); see OrchestratorClient.acquire."""
        await self._ensure_session()
        deadline = self._deadline(timeout)
        self._withdraw.discard(group_id)    # a new acquire of the group supersedes a withdrawal
        st = CallState(Call.ACQUIRE, acquire_deadline=timeout is not None)
        left: list = []                     # this call's attempts left running on replicas we moved off

        def attempt(stub, idx, req, t):
            return self._acquire_attempt(stub, idx, req, t, left)

        try:
            reply = await self._invoke(Call.ACQUIRE, lambda: self._acquire_req(group_id, device_bytes_hint),
                                       deadline=deadline, cap=0, attempt=attempt, st=st)
        except E.TimesliceClientError as e:
            if W.needs_withdraw(e.code, e.details) and not self._lost and not self._closing:
                self._withdraw.add(group_id)
                await self._withdraw_pending(W.FIRST_BUDGET_S)
            raise
        finally:
            self._drop_left(left)
        grant = Grant.from_pb(reply)
        self._grant_held(grant)
        log.info("acquired", job=self.job_id, group=group_id, token=grant.token, epoch=grant.leader_epoch,
                 waited_ms=round(grant.waited_ms, 3), restored=grant.restored)
        if self.after_acquire is not None:
            try:
                await _maybe_await(self.after_acquire(grant))
            except BaseException:
                await self._release_quietly(group_id, grant.token)
                raise
        return grant

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

    def _drop_left(self, left: list) -> None:
        """The call is over: cancel its older attempts (see OrchestratorClient._drop_left)."""
        for item in left:
            call, task = item
            call.cancel()
            task.cancel()
            if item in self._dangling:
                self._dangling.remove(item)
        left.clear()

    async def _acquire_attempt(self, stub: pbg.LockdStub, idx: int, req: pb.AcquireRequest, t: float | None,
                               left: list):
        call = stub.Acquire(req, timeout=t)
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
                    self._dangling.append((call, task))    # keep it alive: see client.py's module doc
                    left.append((call, task))
                    finished = True
                    return _MOVED
        finally:
            if not finished:
                call.cancel()
                task.cancel()

    async def yield_(self, group_id: str, token: int | None = None) -> Released:
        """Release ``group_id``; see OrchestratorClient.yield_."""
        self._check_usable(Call.YIELD)
        tok, held = self._token_for(group_id, token)
        if held is not None and self.before_yield is not None:
            await _maybe_await(self.before_yield(held))
        if self.release_cache:
            await asyncio.to_thread(release_framework_cache)
        await self._ensure_session()

        def build():
            return pb.YieldRequest(job_id=self.job_id, session_secret=self._secret(), group_id=group_id, token=tok)

        try:
            reply = await self._invoke(Call.YIELD, build, deadline=self._deadline(self.config.timeout))
        except (E.NotHolderError, E.StaleTokenError):
            self._forget(group_id, tok)
            raise
        self._forget(group_id, tok)
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

    # == scopes ======================================================================
    def on_accelerators(self, group_id: str, *, timeout: float | None = None,
                        device_bytes_hint: int = 0) -> AcceleratorScope:
        """Decorator / async context manager: hold ``group_id`` while the body runs (see scope.py)."""
        return AcceleratorScope(self, group_id, timeout, device_bytes_hint)

    def _scope_enter(self, group_id: str, timeout, hint):
        raise TypeError("AsyncOrchestratorClient.on_accelerators is an async context manager: "
                        "use `async with`, or the sync OrchestratorClient")

    def _scope_exit(self, group_id: str):
        raise TypeError("use `async with` with AsyncOrchestratorClient")

    async def _scope_enter_async(self, group_id: str, timeout: float | None, hint: int) -> Grant:
        hold = self._holds.setdefault(group_id, _AsyncHold())
        async with hold.mutex:
            if hold.depth == 0 or group_id not in self._held:
                await self.acquire(group_id, timeout, hint)
                hold.depth = 0
            hold.depth += 1
            return self._held[group_id]

    async def _scope_exit_async(self, group_id: str) -> None:
        hold = self._holds.setdefault(group_id, _AsyncHold())
        async with hold.mutex:
            hold.depth = max(0, hold.depth - 1)
            if hold.depth == 0:
                self._check_usable(Call.YIELD)
                if group_id in self._held:
                    await self.yield_(group_id)

    # == workers =====================================================================
    async def cooperate(self, memory, *, node: str | None = None, socket_path: str | None = None,
                        gpus=(), prepin: bool = True):
        """Async twin of ``OrchestratorClient.cooperate``: the channel and its serving thread are
        the same (the agent's requests are answered off the event loop); prepin runs in a thread."""
        from timeslice.config import node_name
        from timeslice.cooperative import CooperativeWorker
        await self._ensure_session()
        node = node or node_name()
        await asyncio.to_thread(self._close_attestation)   # one channel per process
        w = CooperativeWorker(self.job_id, self._secret, memory, node, socket_path)
        pid = await asyncio.to_thread(w.connect)
        try:
            await self.register_worker(pid=pid, node=node, device_bytes=sum(memory.region_bytes().values()),
                                       swap="cooperative", gpus=gpus, tags=dict(memory.tags))
            w.start()
            if prepin and hasattr(memory, "prepin"):
                await asyncio.to_thread(memory.prepin)
                w.announce()
        except BaseException:
            w.close()
            raise
        self._cooperative.append(w)
        return w

    async def register_worker(self, pid: int | None = None, node: str | None = None,
                              device_bytes: int = 0, *, swap: str = "", gpus=(), endpoint: str = "",
                              tags=None, collective: bool = False) -> Worker:
        await self._ensure_session()
        if swap != "cooperative":
            from timeslice.config import node_name
            seen = await asyncio.to_thread(self.attest_worker, node or node_name())
            if pid is None and seen:
                pid = seen                    # the pid as the agent sees it (pid namespaces differ)
        req, w = self._worker_req(pid, node, device_bytes, swap, gpus, endpoint, tags, collective)
        req.session_secret = self._secret()
        await self._invoke(Call.REGISTER_WORKER, lambda: req, deadline=self._deadline(self.config.timeout))
        log.info("worker_registered", job=self.job_id, node=w.node, pid=w.pid)
        return w

    async def unregister_worker(self, pid: int | None = None, node: str | None = None) -> Worker:
        await self._ensure_session()
        req, w = self._worker_req(pid, node, 0)
        req.session_secret = self._secret()
        await self._invoke(Call.UNREGISTER_WORKER, lambda: req, deadline=self._deadline(self.config.timeout))
        return w

    # == admin and status ==============================================================
    async def groups(self) -> list[Group]:
        r = await self._invoke(Call.LIST_GROUPS, pb.ListGroupsRequest, deadline=self._deadline(self.config.timeout))
        return [Group.from_pb(g) for g in r.groups]

    async def status(self, group_id: str) -> GroupStatus:
        r = await self._invoke(Call.GROUP_STATUS, lambda: pb.GroupRef(group_id=group_id),
                               deadline=self._deadline(self.config.timeout))
        return GroupStatus.from_pb(r)

    async def create_group(self, group_id: str, nodes=None) -> Group:
        req = self._create_req(group_id, nodes)
        r = await self._invoke(Call.CREATE_GROUP, lambda: req, deadline=self._deadline(self.config.timeout))
        return Group.from_pb(r)

    async def delete_group(self, group_id: str, force: bool = False) -> bool:
        r = await self._invoke(Call.DELETE_GROUP, lambda: pb.DeleteGroupRequest(group_id=group_id, force=force),
                               deadline=self._deadline(self.config.timeout))
        return True if r is ALREADY_APPLIED else r.deleted

    async def jobs(self) -> list[JobInfo]:
        r = await self._invoke(Call.LIST_JOBS, pb.ListJobsRequest, deadline=self._deadline(self.config.timeout))
        return [JobInfo.from_pb(j) for j in r.jobs]

    async def watch(self, group_id: str, *, timeout: float | None = None) -> AsyncIterator[GroupStatus]:
        """Async iterator over the group's status, now and after every change (see the sync watch)."""
        deadline = self._deadline(timeout)
        last: GroupStatus | None = None
        while True:
            holder: dict[str, Any] = {}

            async def open_stream(stub, idx, req, t, holder=holder):
                call = stub.WatchGroup(req, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                holder.update(call=call, idx=idx)
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise TryAgain("UNAVAILABLE", "watch stream ended")
                return first

            try:
                first = await self._invoke(Call.WATCH_GROUP, lambda: pb.GroupRef(group_id=group_id),
                                           deadline=deadline, cap=0, attempt=open_stream)
            except E.DeadlineError:
                return
            call, idx = holder["call"], holder["idx"]
            try:
                msg = first
                while msg is not grpc.aio.EOF:
                    status = GroupStatus.from_pb(msg)
                    if status != last:
                        last = status
                        yield status
                    msg = await call.read()
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                if code in ("DEADLINE_EXCEEDED", "CANCELLED"):
                    return
                try:
                    self.react(CallState(Call.WATCH_GROUP), idx, code, e.details() or "")
                except TryAgain:
                    continue
            finally:
                call.cancel()

    # == lifecycle =====================================================================
    async def close(self) -> None:
        """Close the session (its holds go with it) and the channels. Idempotent."""
        if self._closed or self._closing:
            return
        self._closing = True
        ka = self._stop_keepalive()
        if ka is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await ka
        workers, self._cooperative = self._cooperative, []
        for w in workers:                 # first: the agent lifts a freeze on a worker that leaves
            await asyncio.to_thread(w.close)
        await asyncio.to_thread(self._close_attestation)
        s = self._session
        if s is not None and self._lost is None:
            await self._close_session(s)
        self._closed = True
        with self._mu:
            self._held.clear()
        for call, task in self._dangling:
            call.cancel()
            task.cancel()
        self._dangling.clear()
        for ch in list(self._channels.values()):
            await ch.close()

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncOrchestratorClient job={self.job_id!r} target={self.target!r} lost={self.session_lost}>"
