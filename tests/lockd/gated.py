"""A lockd replica in the test's own process whose etcd client can hold one transaction back.

Races between replicas are windows of a few milliseconds; to test each interleaving
deterministically the test holds the window open: ``GatedClient.hold(match)`` stops the
first transaction whose operations ``match`` just before it is sent, says so
(``Gate.reached``) and sends it when the test calls ``Gate.go.set()``. Everything else is
real: the etcd client, the etcd, the replica's mirror, leader loop and services.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aetcd import rpc

from timeslice.common.server.etcd import EtcdClient, EtcdConfig
from timeslice.common.server.etcd.timing import ElectionTiming
from timeslice.lockd.config import LockdConfig
from timeslice.lockd.replica import Replica

Match = Callable[[list[rpc.RequestOp]], bool]


@dataclass
class Gate:
    match: Match
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)


class GatedClient(EtcdClient):
    def __init__(self, config: EtcdConfig):
        super().__init__(config)
        self._gates: list[Gate] = []

    def hold(self, match: Match) -> Gate:
        gate = Gate(match)
        self._gates.append(gate)
        return gate

    async def txn(self, compare, success=(), failure=(), *, timeout: float | None = None):
        for gate in list(self._gates):
            if gate.match(list(success)):
                self._gates.remove(gate)
                gate.reached.set()
                await gate.go.wait()
        return await super().txn(compare, success, failure, timeout=timeout)


def all_ops(ops: Iterable[rpc.RequestOp]) -> Iterator[rpc.RequestOp]:
    """Every operation, those of nested transactions included."""
    for op in ops:
        yield op
        if op.HasField("request_txn"):
            yield from all_ops(op.request_txn.success)
            yield from all_ops(op.request_txn.failure)


def puts(key: bytes) -> Match:
    return lambda success: any(op.HasField("request_put") and op.request_put.key == key for op in all_ops(success))


def deletes_prefix(prefix: bytes) -> Match:
    return lambda success: any(op.HasField("request_delete_range") and op.request_delete_range.key == prefix
                               and op.request_delete_range.range_end for op in all_ops(success))


@asynccontextmanager
async def replica_in_process(endpoints: str, prefix: str, replica_id: str = "in-process"):
    """A started Replica (mirror, leader loop, services; no gRPC server) over a GatedClient."""
    cfg = LockdConfig(etcd=EtcdConfig.parse(endpoints), prefix=prefix, replica_id=replica_id, metrics_port=-1,
                      election=ElectionTiming(3, 2.0, 0.5))
    rep = Replica(cfg, client=GatedClient(cfg.etcd))
    await rep.start()
    try:
        yield rep
    finally:
        await rep.stop()


async def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"{what}: not within {timeout}s"
        await asyncio.sleep(0.01)
