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
"""
from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class AcceleratorScope:
    def __init__(self, client: Any, group_id: str, timeout: float | None = None, device_bytes_hint: int = 0):
        self.client, self.group_id = client, group_id
        self.timeout, self.device_bytes_hint = timeout, device_bytes_hint
        self.grant = None

    def _fresh(self) -> AcceleratorScope:
        return AcceleratorScope(self.client, self.group_id, self.timeout, self.device_bytes_hint)

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
        self.grant = self.client._scope_enter(self.group_id, self.timeout, self.device_bytes_hint)
        return self.grant

    def __exit__(self, exc_type, exc, tb) -> None:
        self.client._scope_exit(self.group_id)      # an exception in the block propagates

    async def __aenter__(self):
        self.grant = await self.client._scope_enter_async(self.group_id, self.timeout, self.device_bytes_hint)
        return self.grant

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        await self.client._scope_exit_async(self.group_id)
        return False

    def __repr__(self) -> str:
        return f"<on_accelerators group={self.group_id!r} job={self.client.job_id!r}>"
