"""A watch that survives disconnects and never drops an event silently.

Each ``Watch`` owns one etcd watch stream. It remembers the revision after the
last event it delivered; when the stream breaks (member restart, network) it
re-opens from exactly that revision, so no event is lost or repeated. If that
revision has been compacted, the consumer gets ``WatchCompacted`` and must
re-read state and start a new watch from the read's revision (``Reflector``
in mirror.py does exactly that).

The stream is driven with ``write``/``read`` on the call, not with a request
iterator: grpc.aio consumes a request iterator in a task of its own, which a
broken or cancelled stream left pending (``Task was destroyed but it is
pending``) together with the iterator's async generator (``aclose():
asynchronous generator is already running``) after every reconnect. Reconnects
wait a jittered exponential backoff (backoff.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from aetcd import rpc

from timeslice.common.errors import WatchCompacted
from timeslice.common.server.etcd.backoff import Backoff
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import prefix_range_end

log = structlog.get_logger(__name__)

PUT = rpc.Event.PUT
DELETE = rpc.Event.DELETE


@dataclass(frozen=True)
class WatchEvent:
    type: int                       # PUT or DELETE
    kv: rpc.KeyValue                # for DELETE: the key, with mod_revision = deletion revision
    prev_kv: rpc.KeyValue | None

    @property
    def revision(self) -> int:
        return self.kv.mod_revision

    @property
    def is_put(self) -> bool:
        return self.type == PUT


class Watch:
    """Async iterator of ``list[WatchEvent]`` batches (one batch per etcd response).

    start_revision: the first revision to deliver. Callers pass the revision
    right after a read they made, so nothing between the read and the watch
    can be missed.
    """

    def __init__(self, client: EtcdClient, key: bytes, *, start_revision: int,
                 prefix: bool = False, prev_kv: bool = False, retry_delay: float = 0.1,
                 max_retry_delay: float = 2.0):
        if start_revision <= 0:
            raise ValueError("a watch must start from a known revision")
        self.client = client
        self.key = key
        self.range_end = prefix_range_end(key) if prefix else b""
        self.prev_kv = prev_kv
        self.next_revision = start_revision
        self._backoff = Backoff(retry_delay, max_retry_delay)
        self._closed = False
        self._call = None
        self._gen: AsyncGenerator[list[WatchEvent], None] | None = None
        self.reconnects = 0

    def close(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                await gen.aclose()          # now, by its owner: never left to the garbage collector
            except RuntimeError:
                pass                        # iterated by another task, which ends it itself

    def __aiter__(self) -> AsyncIterator[list[WatchEvent]]:
        self._gen = gen = self._run()
        return gen

    def _request(self) -> rpc.WatchRequest:
        create = rpc.WatchCreateRequest(key=self.key, start_revision=self.next_revision,
                                        prev_kv=self.prev_kv)
        if self.range_end:
            create.range_end = self.range_end
        return rpc.WatchRequest(create_request=create)

    async def _run(self) -> AsyncGenerator[list[WatchEvent], None]:
        while not self._closed:
            await self.client.connect()
            call = self.client.watchstub.Watch(metadata=self.client.watch_metadata())
            self._call = call
            try:
                await call.write(self._request())
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        break
                    if resp.compact_revision:
                        raise WatchCompacted(resp.compact_revision)
                    if resp.canceled:
                        # etcd cancels a watch when its member loses the leader
                        # (we asked with "hasleader"): re-open elsewhere.
                        log.info("watch_canceled_by_server", reason=resp.cancel_reason)
                        break
                    if not resp.events:
                        continue
                    batch = [WatchEvent(ev.type, ev.kv, ev.prev_kv if self.prev_kv else None)
                             for ev in resp.events]
                    # A response carries whole revisions, so resuming after the
                    # last event's revision can neither skip nor repeat one.
                    self.next_revision = batch[-1].kv.mod_revision + 1
                    self._backoff.reset()
                    yield batch
            except grpc.aio.AioRpcError as e:
                if self._closed:
                    return
                log.info("watch_reconnect", key=self.key.decode(errors="replace"),
                         from_revision=self.next_revision, error=e.code().name)
            finally:
                call.cancel()
                if self._call is call:
                    self._call = None
            if self._closed:
                return
            self.reconnects += 1
            await asyncio.sleep(self._backoff.next())
