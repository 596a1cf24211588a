"""The synchronous client: ``OrchestratorClient`` (alias ``TimeSliceOrchestratorClient``).

    from timeslice import OrchestratorClient
    orchestrator = OrchestratorClient(target="lockd:50051", job_id="job-1")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train(batch): ...

Session. The job's session is opened *lazily*, by the first call that needs
it (acquire, yield, register_worker), not by the constructor: a client can be
made at import time, before lockd is up, and admin-only users (the CLI) never
open one. Once open, a daemon thread renews it every TTL/3 with KeepAlive. If
the session is lost (lockd answers ABORTED, or no keepalive succeeded for a
whole TTL), every later session call raises ``SessionLostError`` and
``on_session_lost(error)`` fires once, from the thread that noticed; the
client then refuses session calls until ``reset_session()``.

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

Session. The keepalive watchdog counts from when the OpenSession attempt that
opened the session was sent (the lease is younger), not from when the call
began: a restarted job's OpenSession may wait a whole TTL for its predecessor's
session to expire.
"""
from __future__ import annotations

import asyncio
import atexit
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
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
_POLL = 0.2          # s; how often a blocked acquire looks at session loss / failover / close
_MOVED = object()    # an acquire attempt left its replica (failover) and must be re-sent


class _Hold:
    """Scope bookkeeping for one group: how many scopes are inside, guarded by a mutex."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.depth = 0


class OrchestratorClient(ClientCore):
    """Acquire and yield GPU groups on behalf of one job (see the module doc)."""

    is_async = False

    def __init__(self, target: str | Sequence[str] | None = None, job_id: str | None = None, *,
                 session_ttl: int = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None = None,
                 release_cache: bool = True, before_yield: Callable[[Grant], Any] | None = None,
                 after_acquire: Callable[[Grant], Any] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: RetryPolicy | None = None):
        """
        target: lockd address(es): "host:port", "h1:p,h2:p", a list, or a DNS name
            (default: $TIMESLICE_TARGET, else 127.0.0.1:50051).
        job_id: this job's id (default: $TIMESLICE_JOB_ID, else a generated, logged one).
        session_ttl: seconds lockd keeps the job's holds after its last keepalive (3..300).
        timeout: overall deadline, failover included, of every call that does not block
            by design (acquire has its own timeout; watch runs until stopped).
        on_session_lost: called once with the SessionLostError when the session is lost.
        release_cache: before each yield, empty torch's CUDA cache if torch is loaded.
        before_yield / after_acquire: called with the Grant around each hold.
        credentials: grpc channel credentials for TLS (default: plaintext).
        retry: backoff / failover settings (timeslice.retry.RetryPolicy).
        """
        super().__init__(target, job_id, session_ttl=session_ttl, timeout=timeout,
                         on_session_lost=on_session_lost, release_cache=release_cache,
                         before_yield=before_yield, after_acquire=after_acquire,
                         credentials=credentials, retry=retry)
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pbg.LockdStub] = {}
        self._open_mu = threading.Lock()
        self._ka_stop = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self._holds: dict[str, _Hold] = {}
        self._dangling: list[grpc.Future] = []
        self._withdraw: set[str] = set()            # groups whose failed acquire is still to take back
        self._withdraw_mu = threading.Lock()
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c._close_quietly()
        atexit.register(self._atexit)

    # == plumbing ==================================================================
    def _stub(self, idx: int) -> pbg.LockdStub:
        with self._mu:
            stub = self._stubs.get(idx)
            if stub is None:
                t = self.config.targets[idx]
                ch = (grpc.secure_channel(t, self._credentials, options=CHANNEL_OPTIONS) if self._credentials
                      else grpc.insecure_channel(t, options=CHANNEL_OPTIONS))
                self._channels[idx], stub = ch, pbg.LockdStub(ch)
                self._stubs[idx] = stub
            return stub

    def _invoke(self, call: Call, build: Callable[[], Any], *, deadline: float | None,
                cap: float | None = None, attempt: Callable | None = None, st: CallState | None = None):
        """Send ``build()`` as ``call``, re-sending per retry.py until ``deadline`` (monotonic)."""
        st = st or CallState(call)
        cap = self.config.retry.attempt_timeout if cap is None else cap
        session = self._session

        def once():
            self._check_usable(call)
            idx = self._cur
            stub = self._stub(idx)
            t = attempt_timeout(deadline, cap if cap > 0 else None)
            try:
                if attempt is not None:
                    got = attempt(stub, idx, build(), t)
                    if got is _MOVED:
                        raise TryAgain("UNAVAILABLE", "moved to another replica")
                    return got
                return getattr(stub, call.method)(build(), timeout=t, metadata=metadata_for(call.method))
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                out = self.react(st, idx, code, e.details() or "")
                if out is Action.VERIFY_SESSION:
                    self._verify_session()
                    raise TryAgain(code, e.details() or "") from None
                return out

        retrying = tenacity.Retrying(wait=self.config.retry.wait(), stop=self.config.retry.stop(deadline),
                                     retry=retry_on_try_again(), reraise=True)
        try:
            return retrying(once)
        except TryAgain as last:
            err = self.exhausted(st, last)
        except E.TimesliceClientError as e:
            err = e
        self._note_loss(call, err, session)
        raise err

    def _note_loss(self, call: Call, err: E.TimesliceClientError, session: Session | None) -> None:
        lost = self._loss_from(call, err)
        if lost is not None:
            self._fire(self._take_loss(lost, session), lost)

    def _fire(self, cb: Callable | None, err: E.SessionLostError) -> None:
        if cb is None:
            return
        try:
            res = cb(err)
            if asyncio.iscoroutine(res):
                res.close()
                log.warning("session_lost_callback_is_async", hint="use AsyncOrchestratorClient for async callbacks")
        except Exception:
            log.exception("session_lost_callback_failed", job=self.job_id)

    # == session ===================================================================
    def _ensure_session(self) -> Session:
        self._check_usable(Call.ACQUIRE)
        s = self._session
        if s is not None:
            return s
        with self._open_mu:
            if self._session is not None:
                return self._session
            cfg = self.config
            t0 = time.monotonic()
            sent = [t0]
            # An older session of this job id (a restarted job, or our own attempt
            # whose reply was lost) is waited out: it expires within its TTL.
            reply = self._invoke(Call.OPEN_SESSION, lambda: self._open_req(sent),
                                 deadline=t0 + cfg.timeout + cfg.session_ttl)
            s = Session(reply.session_secret, reply.lease_id, reply.ttl_seconds or cfg.session_ttl, sent[0])
            with self._mu:
                self._session = s
            log.info("session_opened", job=self.job_id, lease=s.lease_id, ttl=s.ttl, target=self.target)
            self._ka_stop = threading.Event()          # one per session: a reset stops only the old loop
            self._ka_thread = threading.Thread(target=self._keepalive_loop, args=(s, self._ka_stop),
                                               daemon=True,
                                               name=f"timeslice-keepalive-{self.job_id}")
            self._ka_thread.start()
            return s

    def open_session(self) -> int:
        """Open the session now instead of on first use; returns its lease id."""
        return self._ensure_session().lease_id

    def _keepalive_loop(self, s: Session, stop: threading.Event) -> None:
        cfg = self.config
        last_ok = s.opened_at
        while not stop.wait(cfg.keepalive_period):
            if self._session is not s or self._closed:
                return
            t0 = time.monotonic()
            try:
                self._invoke(Call.KEEPALIVE, self._ref, deadline=last_ok + s.ttl,
                             cap=cfg.keepalive_attempt_timeout)
                last_ok = t0
                if self._withdraw:
                    self._withdraw_pending(cfg.keepalive_period / 2)
            except (E.SessionLostError, E.AuthError, E.ClientClosedError):
                return                                  # _invoke recorded the loss
            except E.TimesliceClientError as e:
                if time.monotonic() - last_ok >= s.ttl:
                    lost = E.SessionLostError(
                        f"no keepalive of job {self.job_id!r} succeeded for {s.ttl}s (last error: {e}); "
                        "its lease has expired")
                    self._fire(self._take_loss(lost, s), lost)
                    return
                log.warning("keepalive_failed", job=self.job_id, error=str(e))

    def _verify_session(self) -> None:
        """One KeepAlive: raises SessionLostError if the session is really gone."""
        self._invoke(Call.KEEPALIVE, self._ref, deadline=self._deadline(self.config.timeout),
                     cap=self.config.keepalive_attempt_timeout)

    def reset_session(self) -> None:
        """Forget a lost session (or close a live one) so that the next call opens a new one."""
        with self._open_mu:
            s, lost = self._session, self._lost
            self._ka_stop.set()
            if s is not None and lost is None:
                self._close_session(s)
            with self._mu:
                self._session, self._lost = None, None
                self._held.clear()
                self._holds.clear()

    def _close_session(self, s: Session, budget: float = 5.0) -> None:
        try:
            self._invoke(Call.CLOSE_SESSION, self._ref, deadline=self._deadline(min(self.config.timeout, budget)))
            log.info("session_closed", job=self.job_id, lease=s.lease_id)
        except E.TimesliceClientError as e:
            log.warning("session_close_failed", job=self.job_id, error=str(e),
                        hint="the lease expires by itself within its TTL")

    # == acquire / yield =============================================================
    def acquire(self, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0) -> Grant:
        """Block until this job holds ``group_id`` (FIFO); returns the Grant.

        timeout: seconds to wait; None waits for as long as it takes. On timeout
        the job's place in the queue is given up and AcquireTimeoutError raised.
        Calling it while holding the group returns the same grant at once.
        """
        self._ensure_session()
        with self._withdraw_mu:             # a new acquire of the group supersedes a withdrawal
            self._withdraw.discard(group_id)
        deadline = self._deadline(timeout)
        st = CallState(Call.ACQUIRE, acquire_deadline=timeout is not None)
        left: list[grpc.Future] = []        # this call's attempts left running on replicas we moved off

        def attempt(stub, idx, req, t):
            return self._acquire_attempt(stub, idx, req, t, left)

        try:
            reply = self._invoke(Call.ACQUIRE, lambda: self._acquire_req(group_id, device_bytes_hint),
                                 deadline=deadline, cap=0, attempt=attempt, st=st)
        except E.TimesliceClientError as e:
            if W.needs_withdraw(e.code, e.details) and not self._lost and not self._closing:
                with self._withdraw_mu:
                    self._withdraw.add(group_id)
                self._withdraw_pending(W.FIRST_BUDGET_S)
            raise
        finally:
            self._drop_left(left)
        grant = Grant.from_pb(reply)
        self._grant_held(grant)
        log.info("acquired", job=self.job_id, group=group_id, token=grant.token, epoch=grant.leader_epoch,
                 waited_ms=round(grant.waited_ms, 3), restored=grant.restored)
        if self.after_acquire is not None:
            try:
                self.after_acquire(grant)
            except BaseException:
                self._release_quietly(group_id, grant.token)
                raise
        return grant

    def _withdraw_pending(self, budget: float) -> None:
        """Take back the entries failed acquires may have left (see withdraw.py)."""
        with self._withdraw_mu:
            for group in sorted(self._withdraw):
                if self._withdraw_one(group, budget):
                    self._withdraw.discard(group)
                    log.info("acquire_withdrawn", job=self.job_id, group=group)

    def _withdraw_one(self, group: str, budget: float) -> bool:
        end = time.monotonic() + budget
        n = 0
        while time.monotonic() < end and not self._closed and self._lost is None:
            idx = self._cur
            try:
                r = self._stub(idx).Acquire(self._acquire_req(group, 0), timeout=W.ATTEMPT_S)
                code, details = None, ""
            except grpc.RpcError as e:
                code, details = (e.code().name if e.code() else "UNKNOWN"), e.details() or ""
            v = W.verdict(code, details)
            if v is W.Verdict.GRANTED:
                self._release_quietly(group, r.token)   # granted to nobody: hand it straight back
                return True
            if v is W.Verdict.DONE:
                return True
            self._failover(idx, f"withdraw: {code}")
            n += 1
            time.sleep(min(max(0.0, end - time.monotonic()), 0.05 * n))
        return False

    def _drop_left(self, left: list[grpc.Future]) -> None:
        """The call is over: its older attempts are of no use any more. Cancelling one makes
        its replica withdraw it, which changes nothing once a newer attempt took the entry
        over (lockd removes only what the attempt still owns)."""
        with self._mu:
            for fut in left:
                fut.cancel()
                if fut in self._dangling:
                    self._dangling.remove(fut)
            left.clear()

    def _acquire_attempt(self, stub: pbg.LockdStub, idx: int, req: pb.AcquireRequest, t: float | None,
                         left: list[grpc.Future]):
        fut = stub.Acquire.future(req, timeout=t)
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        gen0 = self._gen
        finished = False
        try:
            while not done.wait(_POLL):
                if self._closed or self._lost is not None:
                    self._check_usable(Call.ACQUIRE)
                if t is None and self._gen != gen0 and self._cur != idx:
                    with self._mu:
                        self._dangling.append(fut)     # keep it alive: see the module doc
                        left.append(fut)
                    finished = True
                    return _MOVED
            finished = True
            return fut.result()
        finally:
            if not finished:
                fut.cancel()                           # our caller gave up (or the session is gone)

    def yield_(self, group_id: str, token: int | None = None) -> Released:
        """Release ``group_id``. ``token`` defaults to the one this client's acquire returned.

        Runs ``before_yield(grant)``, then empties torch's CUDA cache (if
        ``release_cache``), then sends Yield. A re-sent Yield whose first
        attempt was applied counts as success (``released=True``).
        """
        self._check_usable(Call.YIELD)
        tok, held = self._token_for(group_id, token)
        if held is not None and self.before_yield is not None:
            self.before_yield(held)
        if self.release_cache:
            release_framework_cache()
        self._ensure_session()

        def build():
            return pb.YieldRequest(job_id=self.job_id, session_secret=self._secret(), group_id=group_id, token=tok)

        try:
            reply = self._invoke(Call.YIELD, build, deadline=self._deadline(self.config.timeout))
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

    def _release_quietly(self, group_id: str, token: int) -> None:
        try:
            self.yield_(group_id, token)
        except E.TimesliceClientError as e:
            log.warning("release_failed", job=self.job_id, group=group_id, token=token, error=str(e))

    # == scopes ======================================================================
    def on_accelerators(self, group_id: str, *, timeout: float | None = None,
                        device_bytes_hint: int = 0) -> AcceleratorScope:
        """Decorator / context manager: hold ``group_id`` while the body runs (see scope.py)."""
        return AcceleratorScope(self, group_id, timeout, device_bytes_hint)

    def _hold(self, group_id: str) -> _Hold:
        with self._mu:
            return self._holds.setdefault(group_id, _Hold())

    def _scope_enter(self, group_id: str, timeout: float | None, hint: int) -> Grant:
        hold = self._hold(group_id)
        with hold.mutex:
            if hold.depth == 0 or group_id not in self._held:
                self.acquire(group_id, timeout, hint)
                hold.depth = 0
            hold.depth += 1
            return self._held[group_id]

    def _scope_exit(self, group_id: str) -> None:
        hold = self._hold(group_id)
        with hold.mutex:
            hold.depth = max(0, hold.depth - 1)
            if hold.depth == 0:
                self._check_usable(Call.YIELD)
                if group_id in self._held:
                    self.yield_(group_id)

    async def _scope_enter_async(self, group_id: str, timeout: float | None, hint: int) -> Grant:
        return await asyncio.to_thread(self._scope_enter, group_id, timeout, hint)

    async def _scope_exit_async(self, group_id: str) -> None:
        await asyncio.to_thread(self._scope_exit, group_id)

    # == workers =====================================================================
    def register_worker(self, pid: int | None = None, node: str | None = None, device_bytes: int = 0, *,
                        swap: str = "", gpus=(), endpoint: str = "", tags=None,
                        collective: bool = False) -> Worker:
        """Tell the node agents that process ``pid`` (default: this one) on ``node``
        (default: $TIMESLICE_NODE_NAME, else the host name) holds this job's device memory.

        ``swap`` says how the agent moves it: "checkpoint" (default, CUDA checkpoint of the
        whole process), "cooperative" (the process pauses itself; see ``timeslice.cooperative``),
        "vllm"/"sglang" (the server's HTTP API at ``endpoint``). ``gpus``: the node's GPU indexes
        it uses. ``tags``: region -> "offload"|"discard". ``collective``: it uses CUDA IPC/NCCL p2p,
        so its context must never be checkpointed."""
        self._ensure_session()
        if swap != "cooperative":
            from timeslice.config import node_name
            seen = self.attest_worker(node or node_name())
            if pid is None and seen:
                pid = seen                    # the pid as the agent sees it (pid namespaces differ)
        req, w = self._worker_req(pid, node, device_bytes, swap, gpus, endpoint, tags, collective)
        self._invoke(Call.REGISTER_WORKER, lambda: _with_secret(req, self._secret()),
                     deadline=self._deadline(self.config.timeout))
        log.info("worker_registered", job=self.job_id, node=w.node, pid=w.pid)
        return w

    def unregister_worker(self, pid: int | None = None, node: str | None = None) -> Worker:
        self._ensure_session()
        req, w = self._worker_req(pid, node, 0)
        self._invoke(Call.UNREGISTER_WORKER, lambda: _with_secret(req, self._secret()),
                     deadline=self._deadline(self.config.timeout))
        return w

    def cooperate(self, memory, *, node: str | None = None, socket_path: str | None = None,
                  gpus: Sequence[int] = (), prepin: bool = True):
        """Make this process a *cooperative* worker: it moves its own device memory when asked.

        Opens the node-local channel to the node agent (which learns this
        process's pid from the kernel), registers the worker with
        ``swap="cooperative"`` and the memory's tags, and serves the agent's
        pause/resume requests on a daemon thread. ``prepin`` pays the one-time
        cost of allocating the retained pinned host backup now (call this while
        the job holds a group, before its loop), not during the first swap.
        Returns the ``CooperativeWorker``; ``close()`` closes it too.
        """
        from timeslice.config import node_name
        from timeslice.cooperative import CooperativeWorker
        self._ensure_session()
        node = node or node_name()
        self._close_attestation()        # one channel per process: the cooperative one attests too
        w = CooperativeWorker(self.job_id, self._secret, memory, node, socket_path)
        pid = w.connect()
        try:
            self.register_worker(pid=pid, node=node, device_bytes=sum(memory.region_bytes().values()),
                                 swap="cooperative", gpus=gpus, tags=dict(memory.tags))
            w.start()
            if prepin and hasattr(memory, "prepin"):
                t0 = time.monotonic()
                memory.prepin()
                w.announce()
                log.info("cooperative_prepinned", job=self.job_id, host_bytes=memory.host_bytes(),
                         elapsed_s=round(time.monotonic() - t0, 3))
        except BaseException:
            w.close()
            raise
        with self._mu:
            self._cooperative.append(w)
        return w

    # == admin and status ==============================================================
    def groups(self) -> list[Group]:
        r = self._invoke(Call.LIST_GROUPS, pb.ListGroupsRequest, deadline=self._deadline(self.config.timeout))
        return [Group.from_pb(g) for g in r.groups]

    def status(self, group_id: str) -> GroupStatus:
        r = self._invoke(Call.GROUP_STATUS, lambda: pb.GroupRef(group_id=group_id),
                         deadline=self._deadline(self.config.timeout))
        return GroupStatus.from_pb(r)

    def create_group(self, group_id: str, nodes=None) -> Group:
        """Create ``group_id`` over ``nodes`` ("node", "node:0,1", (node, [gpus]) or NodeSpec).
        Re-creating it with the same nodes is a no-op."""
        req = self._create_req(group_id, nodes)
        r = self._invoke(Call.CREATE_GROUP, lambda: req, deadline=self._deadline(self.config.timeout))
        return Group.from_pb(r)

    def delete_group(self, group_id: str, force: bool = False) -> bool:
        """Delete ``group_id``; refused while jobs are queued unless ``force``."""
        r = self._invoke(Call.DELETE_GROUP, lambda: pb.DeleteGroupRequest(group_id=group_id, force=force),
                         deadline=self._deadline(self.config.timeout))
        return True if r is ALREADY_APPLIED else r.deleted

    def jobs(self) -> list[JobInfo]:
        r = self._invoke(Call.LIST_JOBS, pb.ListJobsRequest, deadline=self._deadline(self.config.timeout))
        return [JobInfo.from_pb(j) for j in r.jobs]

    def watch(self, group_id: str, *, timeout: float | None = None) -> Iterator[GroupStatus]:
        """Yield the group's status now and after every change, until the caller stops
        iterating (or ``timeout`` seconds pass). Replicas that fail are left for the next
        one; the stream restarts there with a full picture, and unchanged pictures are
        not repeated."""
        deadline = self._deadline(timeout)
        last: GroupStatus | None = None
        while True:
            holder: dict[str, Any] = {}

            def open_stream(stub, idx, req, t, holder=holder):
                call = stub.WatchGroup(req, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                try:
                    first = next(call)
                except StopIteration:
                    raise TryAgain("UNAVAILABLE", "watch stream ended") from None
                holder.update(call=call, idx=idx)
                return first

            try:
                first = self._invoke(Call.WATCH_GROUP, lambda: pb.GroupRef(group_id=group_id), deadline=deadline,
                                     cap=0, attempt=open_stream)
            except E.DeadlineError:
                return
            call, idx = holder["call"], holder["idx"]
            try:
                msg = first
                while True:
                    status = GroupStatus.from_pb(msg)
                    if status != last:
                        last = status
                        yield status
                    msg = next(call)
            except StopIteration:
                pass
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                if code == "DEADLINE_EXCEEDED" or code == "CANCELLED":
                    return
                try:
                    self.react(CallState(Call.WATCH_GROUP), idx, code, e.details() or "")
                except TryAgain:
                    continue
            finally:
                call.cancel()

    # == lifecycle =====================================================================
    def close(self, timeout: float = 5.0) -> None:
        """Close the session (its holds go with it) and the channels. Idempotent.

        ``timeout`` bounds the CloseSession call; if lockd cannot be reached the
        lease simply expires within its TTL."""
        with self._mu:
            if self._closed or self._closing:
                return
            self._closing = True          # a deliberate close is not a session loss
        self._ka_stop.set()
        with self._mu:
            workers, self._cooperative = self._cooperative, []
        for w in workers:                 # first: the agent lifts a freeze on a worker that leaves
            w.close()
        self._close_attestation()
        s = self._session
        if s is not None and self._lost is None:
            self._close_session(s, timeout)
        with self._mu:
            self._closed = True
            self._held.clear()
            channels = list(self._channels.values())
            self._dangling.clear()
        for ch in channels:
            ch.close()
        t = self._ka_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
        atexit.unregister(self._atexit)

    def _close_quietly(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<OrchestratorClient job={self.job_id!r} target={self.target!r} lost={self.session_lost}>"


def _with_secret(req, secret: str):
    req.session_secret = secret
    return req


#: The name the reference material uses; the same class.
TimeSliceOrchestratorClient = OrchestratorClient
