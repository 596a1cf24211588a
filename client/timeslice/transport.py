"""Sending one call: a grpc.aio channel per target, re-sent per retry.py's rules.

``Transport.invoke`` is the one driver of retry.py's rules: it sends an
attempt, feeds a failed status to ``ClientCore.react`` and does what it says
(re-send after tenacity's jittered backoff, fail over, verify the session,
succeed, raise). Every call of both faces goes through it. A call that proves
the session lost records the loss in the core and tells the user through
``UserCode`` (usercode.py).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import tenacity

from timeslice import errors as E
from timeslice.auth import metadata_for
from timeslice.config import CHANNEL_OPTIONS
from timeslice.core import ClientCore, SessionInfo
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.retry import (
    Action,
    Call,
    CallState,
    TryAgain,
    attempt_timeout,
    retry_on_try_again,
)
from timeslice.usercode import UserCode

#: Returned by an attempt that left its replica (failover) and must be re-sent.
MOVED = object()


class Transport:
    """Channels and the call driver.

    ``verify_session``: one KeepAlive that raises if the session is really gone (the
    session room's; what an Acquire's ABORTED asks for before it is believed)."""

    def __init__(self, core: ClientCore, user: UserCode, credentials: grpc.ChannelCredentials | None,
                 verify_session: Callable[[], Awaitable[None]]):
        self.core, self.user = core, user
        self._credentials = credentials
        self._verify_session = verify_session
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pbg.LockdStub] = {}

    def stub(self, idx: int) -> pbg.LockdStub:
        stub = self._stubs.get(idx)
        if stub is None:
            t = self.core.config.targets[idx]
            # Made on first use, inside the running loop: a grpc.aio channel belongs to one loop.
            ch = (grpc.aio.secure_channel(t, self._credentials, options=CHANNEL_OPTIONS) if self._credentials
                  else grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS))
            self._channels[idx], stub = ch, pbg.LockdStub(ch)
            self._stubs[idx] = stub
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for ch in channels:
            await ch.close()

    async def invoke(self, call: Call, build: Callable[[], Any], *, deadline: float | None,
                     cap: float | None = None, attempt: Callable | None = None, st: CallState | None = None):
        """Send ``build()`` as ``call``, re-sending per retry.py until ``deadline`` (monotonic).

        ``cap``: deadline of one attempt (default: the policy's; 0: none, for calls that block
        by design). ``attempt(stub, idx, request, timeout)``: a coroutine that sends one attempt
        itself (streams, acquire); it returns ``MOVED`` to be re-sent elsewhere."""
        core = self.core
        st = st or CallState(call)
        cap = core.config.retry.attempt_timeout if cap is None else cap
        session = core.session

        async def once():
            core.check_usable(call)
            idx = core.cur
            stub = self.stub(idx)
            t = attempt_timeout(deadline, cap if cap > 0 else None)
            try:
                if attempt is not None:
                    got = await attempt(stub, idx, build(), t)
                    if got is MOVED:
                        raise TryAgain("UNAVAILABLE", "moved to another replica")
                    return got
                return await getattr(stub, call.method)(build(), timeout=t, metadata=metadata_for(call.method))
            except grpc.RpcError as e:
                code = e.code().name if e.code() is not None else "UNKNOWN"
                out = core.react(st, idx, code, e.details() or "")
                if out is Action.VERIFY_SESSION:
                    await self._verify_session()
                    raise TryAgain(code, e.details() or "") from None
                return out

        try:
            try:
                return await once()          # the common case: one attempt, no retry machinery
            except TryAgain as e:
                first: TryAgain | None = e

            async def again():
                nonlocal first
                if first is not None:        # tenacity counts the failed first attempt, then waits
                    e, first = first, None
                    raise e
                return await once()
            retrying = tenacity.AsyncRetrying(wait=core.config.retry.wait(), stop=core.config.retry.stop(deadline),
                                              retry=retry_on_try_again(), reraise=True)
            return await retrying(again)
        except TryAgain as last:
            err = core.exhausted(st, last)
        except E.TimesliceClientError as e:
            err = e
        await self._note_loss(call, err, session)
        raise err

    async def _note_loss(self, call: Call, err: E.TimesliceClientError, session: SessionInfo | None) -> None:
        lost = self.core.loss_from(call, err)
        if lost is not None:
            await self.user.fire(self.core.take_loss(lost, session), lost, "on_session_lost")
