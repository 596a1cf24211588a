"""A chaos client that drives the public client library (``python -m chaos_tests.client_proc --library``).

client_proc.py's default client speaks raw gRPC, so that the history shows what
lockd answered. This one judges the *library*: what a job written
against ``OrchestratorClient`` sees when its replica stalls, when its process is
restarted under the same job id, when its session is lost. Same loop, same
events, same fenced resource as the raw client, plus:

    session_lost  job, lease, lease_ttl_left   on_session_lost fired; etcd was asked about
                                               the lease at once (LeaseTimeToLive, -1 = gone)

After a failed acquire it waits ``--error-pause`` seconds (a job backing off): a
grant that the server made for that failed call, if any, is then not hidden by the
job's next turn finding it.

A process restarted under the same job id counts the fenced operations its job
made before it (``FencedResource.ops`` at start-up), so its final data check holds
its predecessors to the same account.
"""
from __future__ import annotations

import os
import random
import threading
import time

import grpc
from aetcd import rpc

from chaos_tests.history import FencedResource, HistoryRecorder, MiB, fence_path
from timeslice import OrchestratorClient
from timeslice.errors import SessionLostError, TimesliceClientError


def lease_ttl_left(endpoints: str, lease: int | None) -> int | None:
    """What etcd says of ``lease`` now: seconds to live, -1 when gone; None if nobody answered."""
    if not endpoints or not lease:
        return None
    for ep in endpoints.split(","):
        with grpc.insecure_channel(ep.strip()) as ch:
            try:
                return int(rpc.LeaseStub(ch).LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease), timeout=2).TTL)
            except grpc.RpcError:
                continue
    return None


class LibClient:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.rec = HistoryRecorder(a.history, name=f"client-{a.job}", job=a.job)
        self.groups = a.groups.split(",")
        self.fences = {g: FencedResource(fence_path(a, g)) for g in self.groups}
        self.accepted = {g: self.fences[g].ops(g, a.job) for g in self.groups}
        self.stop = threading.Event()
        self.c = OrchestratorClient(a.targets.split(","), job_id=a.job, session_ttl=a.ttl, release_cache=False,
                                    on_session_lost=self.on_lost)

    def on_lost(self, err: SessionLostError) -> None:
        lease = self.c.lease_id
        self.rec.record("session_lost", lease=lease, lease_ttl_left=lease_ttl_left(self.a.etcd, lease),
                        message=str(err)[:200])

    def failed(self, group: str, e: TimesliceClientError, **kw) -> None:
        self.rec.error(group, str(e)[:300], kind=type(e).__name__, code=e.code, **kw)
        if isinstance(e, SessionLostError) or self.c.session_lost:
            self.c.reset_session()          # what the error message tells a job to do

    def turn(self) -> None:
        group = self.rng.choice(self.groups)
        hint = self.rng.randint(*(int(x * MiB) for x in self.a.hint_mib)) if self.a.hint_mib else 0
        excl = bool(self.a.exclusive_p) and self.rng.random() < self.a.exclusive_p
        self.rec.acquire_req(group, replica=self.c.target, **({"exclusive": True} if excl else {}))
        try:
            g = self.c.acquire(group, timeout=self.a.acquire_timeout, device_bytes_hint=hint, exclusive=excl)
        except TimesliceClientError as e:
            self.failed(group, e)
            self.stop.wait(self.a.error_pause)
            return
        self.rec.granted(group, g.token, epoch=g.leader_epoch, waited_ms=round(g.waited_ms, 1),
                         restored=g.restored, replica=self.c.target, footprint=dict(g.footprint_bytes),
                         exclusive=g.exclusive, backfilled=g.backfilled)
        fence = self.fences[group]
        if not fence.apply(self.rec, group, g.token):
            self.rec.error(group, "fenced off before entering", kind="Fenced", token=g.token)
            try:
                self.c.yield_(group, g.token)
            except TimesliceClientError:
                pass
            return
        self.accepted[group] += 1
        self.rec.cs_start(group, g.token)
        time.sleep(self.rng.uniform(*self.a.cs_ms) / 1000)
        if fence.apply(self.rec, group, g.token):
            self.accepted[group] += 1
        self.rec.cs_end(group, g.token)
        try:
            self.c.yield_(group, g.token)
        except TimesliceClientError as e:
            self.failed(group, e, token=g.token)
            return
        self.rec.yielded(group, g.token)

    def run(self) -> int:
        self.c.open_session()               # a restarted job waits its predecessor's session out here
        print(f"CLIENT_READY {self.a.job} {os.getpid()}", flush=True)
        end = time.monotonic() + self.a.duration
        turns = 0
        while not self.stop.is_set() and time.monotonic() < end:
            self.turn()
            turns += 1
            time.sleep(self.rng.uniform(*self.a.think_ms) / 1000)
        for g in self.groups:
            self.fences[g].verify(self.rec, g, self.accepted[g])
        self.c.close()
        self.rec.close()
        print(f"done: {turns} turns", flush=True)
        return 0
