"""The asyncio client, ``AsyncOrchestratorClient``: the one implementation of the job client.

    async with AsyncOrchestratorClient(job_id="job-1") as orchestrator:
        grant = await orchestrator.acquire("trainer-group")
        ...
        await orchestrator.yield_("trainer-group")

        @orchestrator.on_accelerators(group_id="sampler-group")
        async def generate(prompts): ...

It is assembled from one module per concept: transport.py (channels, the call
driver, where user code runs), session.py (open, keepalive, loss, revoked
groups), holds.py (acquire, yield, withdrawal, scopes), workers.py (worker
registration, attestation, cooperate) and admin.py (groups, status, watch),
over core.py's state and rules. The sync ``OrchestratorClient`` (client.py)
runs this same class on a private event loop.

Hooks and callbacks may be plain functions or coroutine functions; plain ones
run on the event loop (keep them short). Channels are created on first use,
inside the running loop; use one client per event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from timeslice import errors as E
from timeslice.admin import Admin
from timeslice.config import DEFAULT_TIMEOUT, DEFAULT_TTL
from timeslice.holds import Holds
from timeslice.model import Grant
from timeslice.retry import RetryPolicy
from timeslice.workers import Workers


class AsyncOrchestratorClient(Holds, Workers, Admin):
    """Acquire and yield GPU groups on behalf of one job, from asyncio code."""

    def __init__(self, target: str | Sequence[str] | None = None, job_id: str | None = None, *,
                 session_ttl: int = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 on_session_lost: Callable[[E.SessionLostError], Any] | None = None,
                 release_cache: bool = True, before_yield: Callable[[Grant], Any] | None = None,
                 after_acquire: Callable[[Grant], Any] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: RetryPolicy | None = None,
                 on_grant_revoked: Callable[[E.GroupRevokedError], Any] | None = None):
        """
        target: lockd address(es): "host:port", "h1:p,h2:p", a list, or a DNS name
            (default: $TIMESLICE_TARGET, else 127.0.0.1:50051).
        job_id: this job's id (default: $TIMESLICE_JOB_ID, else $SLURM_JOB_ID, else a generated, logged one).
        session_ttl: seconds lockd keeps the job's holds after its last keepalive (3..300).
        timeout: overall deadline, failover included, of every call that does not block
            by design (acquire has its own timeout; watch runs until stopped).
        on_session_lost: called once with the SessionLostError when the session is lost.
        release_cache: before each yield, empty torch's CUDA cache if torch is loaded.
        before_yield / after_acquire: called with the Grant around each hold.
        credentials: grpc channel credentials for TLS (default: plaintext).
        retry: backoff / failover settings (timeslice.retry.RetryPolicy).
        on_grant_revoked: called with a GroupRevokedError (``.grant``) when an admin deleted
            a group this client held; learnt within a keepalive period (TTL/3).
        """
        super().__init__(target, job_id, session_ttl=session_ttl, timeout=timeout,
                         on_session_lost=on_session_lost, on_grant_revoked=on_grant_revoked,
                         release_cache=release_cache, before_yield=before_yield, after_acquire=after_acquire,
                         credentials=credentials, retry=retry)
        self._init_transport()
        self._init_session()
        self._init_holds()

    async def close(self, timeout: float = 5.0) -> None:
        """Close the session (its holds go with it) and the channels. Idempotent.

        ``timeout`` bounds the CloseSession call; if lockd cannot be reached the
        lease simply expires within its TTL."""
        with self._mu:
            if self._closed or self._closing:
                return
            self._closing = True          # a deliberate close is not a session loss
            if os.getpid() != self._pid:  # a child after fork: the session and channels are the parent's
                self._closed = True
                return
        ka = self._stop_keepalive()
        if ka is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await ka
        await self._close_workers()
        s = self._session
        if s is not None and self._lost is None:
            await self._close_session(s, timeout)
        elif self._lost is not None:
            await self._await_ending(timeout)        # a session it declared lost: ended at lockd if it can
        with self._mu:
            self._closed = True
            self._grants.clear()
        if self._ending is not None:
            self._ending.cancel()
        for call, task in self._dangling:
            call.cancel()
            task.cancel()
        self._dangling.clear()
        await self._close_channels()

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncOrchestratorClient job={self.job_id!r} target={self.target!r} lost={self.session_lost}>"
