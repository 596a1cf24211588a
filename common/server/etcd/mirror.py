"""Reflector: an in-memory mirror of every key under a prefix, kept by one watch.

Read everything at revision R, then watch from R+1: the mirror is always the
exact state of etcd at ``self.revision`` (a consistent snapshot, never a mix).
On compaction it re-reads and re-watches, and tells listeners with
``reset=True`` so they can re-derive whatever they keep. Listeners are called
synchronously, in order, for every batch: nothing is dropped.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog
from aetcd import rpc

from timeslice.common.errors import WatchCompacted
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.backoff import Backoff
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.etcd.watch import Watch, WatchEvent

log = structlog.get_logger(__name__)

Listener = Callable[[list[WatchEvent], bool], None]   # (events, reset)


class Reflector:
    def __init__(self, client: EtcdClient, prefix: bytes):
        self.client = client
        self.prefix = prefix
        self.kvs: dict[bytes, rpc.KeyValue] = {}
        self.revision = 0
        self.synced = asyncio.Event()
        self._listeners: list[Listener] = []
        self._rev_waiters: list[tuple[int, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self.resets = 0

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"reflector-{self.prefix!r}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    def get(self, key: bytes) -> rpc.KeyValue | None:
        return self.kvs.get(key)

    def items(self, prefix: bytes) -> Iterable[tuple[bytes, rpc.KeyValue]]:
        """The keys below ``prefix`` as of now: a snapshot, so a caller may await (or a thread
        read it) while the watch keeps changing the mirror."""
        return [(k, v) for k, v in list(self.kvs.items()) if k.startswith(prefix)]

    async def wait_revision(self, revision: int, timeout: float | None = None) -> None:
        """Wait until the mirror has applied ``revision`` (e.g. of our own write)."""
        if self.revision >= revision:
            return
        fut = asyncio.get_running_loop().create_future()
        self._rev_waiters.append((revision, fut))
        await asyncio.wait_for(fut, timeout)

    async def _load(self) -> int:
        r = await self.client.range(ops.range_req(self.prefix, prefix=True))
        self.kvs = {kv.key: kv for kv in r.kvs}
        self.revision = r.header.revision
        return self.revision

    def _notify(self, events: list[WatchEvent], reset: bool) -> None:
        for fn in list(self._listeners):
            try:
                fn(events, reset)
            except Exception:
                log.exception("reflector_listener_failed")
        still = []
        for rev, fut in self._rev_waiters:
            if self.revision >= rev:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((rev, fut))
        self._rev_waiters = still

    async def _run(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                rev = await self._load()
                self._notify([], True)
                self.synced.set()
                async with Watch(self.client, self.prefix, prefix=True, start_revision=rev + 1) as w:
                    async for batch in w:
                        for ev in batch:
                            if ev.is_put:
                                self.kvs[ev.kv.key] = ev.kv
                            else:
                                self.kvs.pop(ev.kv.key, None)
                        self.revision = batch[-1].revision
                        self._notify(batch, False)
                        backoff.reset()
            except WatchCompacted as e:
                self.resets += 1
                log.info("reflector_resync", reason=str(e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unreachable at load time: keep trying
                log.warning("reflector_retry", error=str(e))
                await asyncio.sleep(backoff.next())
