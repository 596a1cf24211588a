"""``client.on_accelerators(group_id)``: a decorator and a context manager around a hold.

    @client.on_accelerators(group_id="trainer-group")
    def train(batch): ...                # acquire before, yield after, every call

    @client.on_accelerators(group_id="sampler-group")
    async def generate(prompts): ...     # the same for coroutines

    with client.on_accelerators("trainer-group") as grant: ...
    async with client.on_accelerators("trainer-group") as grant: ...

Holds are counted per group and per client: a scope entered while the job
already holds the group through another scope (nested, or in another thread
or task) does not acquire again, and only the last scope to leave yields.

With the async client a decorated *plain* function becomes a coroutine
function whose body runs in a worker thread (``asyncio.to_thread``), so a long
GPU phase never stalls the event loop that keeps the session alive.

``Scopes`` is the count: one per client, it takes the client's core and holds
(holds.py) and acquires or yields through them.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from timeslice.retry import Call

if TYPE_CHECKING:
    from timeslice.core import ClientCore
    from timeslice.holds import Holds
    from timeslice.model import Grant

F = TypeVar("F", bound=Callable[..., Any])


class _Hold:
    """Scope bookkeeping for one group: how many scopes are inside, guarded by a mutex."""

    def __init__(self) -> None:
        self.mutex = asyncio.Lock()
        self.depth = 0


class Scopes:
    """How many scopes of each group are inside, per client: the first in acquires, the last out yields."""

    def __init__(self, core: ClientCore, holds: Holds):
        self.core, self.holds = core, holds
        self._holds: dict[str, _Hold] = {}

    async def enter(self, group_id: str, timeout: float | None, hint: int, priority: int = 0,
                    exclusive: bool = False) -> Grant:
        hold = self._holds.setdefault(group_id, _Hold())
        async with hold.mutex:
            if hold.depth == 0 or group_id not in self.core.grants:
                await self.holds.acquire(group_id, timeout, hint, priority=priority, exclusive=exclusive)
                hold.depth = 0
            hold.depth += 1
            return self.core.grants.check(group_id)

    async def exit(self, group_id: str) -> None:
        hold = self._holds.setdefault(group_id, _Hold())
        async with hold.mutex:
            hold.depth = max(0, hold.depth - 1)
            if hold.depth == 0:
                self.core.check_usable(Call.YIELD)
                grants = self.core.grants
                if group_id in grants or grants.ends_in_error(group_id):
                    await self.holds.yield_(group_id)   # a revoked hold raises GroupRevokedError

    def clear(self) -> None:
        """The session was reset: no scope counts any more."""
        self._holds.clear()


class AcceleratorScope:
    def __init__(self, client: Any, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0,
                 priority: int = 0, exclusive: bool = False):
        self.client, self.group_id = client, group_id
        self.timeout, self.device_bytes_hint, self.priority = timeout, device_bytes_hint, priority
        self.exclusive = exclusive
        self.grant = None

    def _fresh(self) -> AcceleratorScope:
        return AcceleratorScope(self.client, self.group_id, self.timeout, self.device_bytes_hint, self.priority,
                                self.exclusive)

    # -- decorator ------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_coroutine(*args, **kwargs):
                async with self._fresh():
                    return await fn(*args, **kwargs)
            return run_coroutine  # type: ignore[return-value]
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError("on_accelerators cannot wrap a generator; use it as a context manager inside it")
        if getattr(self.client, "is_async", False):
            @functools.wraps(fn)
            async def run_in_thread(*args, **kwargs):
                async with self._fresh():
                    return await asyncio.to_thread(fn, *args, **kwargs)
            return run_in_thread  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self._fresh():
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]

    # -- context managers -------------------------------------------------------
    def __enter__(self):
        self.grant = self.client._scope_enter(self.group_id, self.timeout, self.device_bytes_hint, self.priority,
                                              self.exclusive)
        return self.grant

    def __exit__(self, exc_type, exc, tb) -> None:
        self.client._scope_exit(self.group_id)      # an exception in the block propagates

    async def __aenter__(self):
        self.grant = await self.client._scope_enter_async(self.group_id, self.timeout, self.device_bytes_hint,
                                                          self.priority, self.exclusive)
        return self.grant

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        await self.client._scope_exit_async(self.group_id)
        return False

    def __repr__(self) -> str:
        return f"<on_accelerators group={self.group_id!r} job={self.client.job_id!r}>"
