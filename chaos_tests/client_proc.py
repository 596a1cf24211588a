"""A chaos client: one job in its own OS process, looping acquire → fenced section → yield.

    python -m chaos_tests.client_proc --targets h:p,h:p,h:p --job c1 --groups g0,g1 \
        --history DIR --fence-dir DIR --seed 7 --duration 20

Each turn picks a group, asks for it, and once granted *claims* the shared
resource (``FencedResource``, one file per group) with its token before
entering the critical section, and ends the section with a second fenced
operation: a holder that lost its lock (a pause past its session TTL) is
then stopped by the fence, and the checker sees exactly where. Everything is
recorded with ``HistoryRecorder``; the checker judges the merged history.

It speaks raw gRPC through the raw job client the benchmarks use too
(``timeslice.testing.rawjob``: lockd's stubs and a small failover, no client
library), so that what the history shows is what lockd answered, not what a
library made of it:

* KeepAlive every ttl/3 to the current replica; a replica that does not
  answer within ``--rpc-timeout`` (killed, paused, cut off from etcd) is left
  for the next one.
* Acquire is sent without a short deadline; when its replica is left, it is
  re-sent to the next one *and the first call is left running* (numbered
  attempts; see rawjob.py).
* Yield is re-sent with the same token after UNAVAILABLE / DEADLINE_EXCEEDED;
  ``not_queued`` on a re-sent Yield means the earlier one applied.
* ABORTED means the session is gone: the attempt is recorded as an ``error``,
  and a new session is opened under the same job id.

With ``--sim-bytes`` the process is also the job's GPU worker on the
SIMULATED device (``timeslice.nodeagent.sim``, see device.py): it allocates an arena,
registers itself with lockd as the job's worker on ``--node``, and inside every
critical section checks that its device bytes are exactly what it left there
(the node agent may have snapshotted and restored them in between), recording
a ``data_check``, then changes them. With ``--coop-regions`` it is a *cooperative*
worker instead (coopdevice.py): its tagged regions are paused and resumed by the
job itself when the agent asks, over its channel (``--agent-socket``). Either
way, each section starts with a ``memory`` report: is the job's memory back?

On SIGTERM, or after ``--duration`` seconds, it finishes its current turn,
records a ``data_check`` per group (the resource kept every operation it
accepted from this job), closes its session and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import threading
import time

import grpc

from chaos_tests.coopdevice import SimCoopWorkerDevice
from chaos_tests.device import SimWorkerDevice
from chaos_tests.history import FencedResource, HistoryRecorder, MiB, fence_path
from timeslice.testing.rawjob import GiveUp, RawJob, RawSessionLost


class AttemptFailed(Exception):
    """The attempt ended with an explicit error other than session loss."""

    code = ""


def log(msg: str) -> None:
    print(f"{time.monotonic():.3f} {msg}", file=sys.stderr, flush=True)


def failure(method: str, e: BaseException) -> Exception:
    """What a failed call means for the history: ``RawSessionLost``, or ``AttemptFailed`` with the reason
    (and its gRPC ``code``, for the checker's status rule)."""
    if isinstance(e, RawSessionLost):
        return e
    if isinstance(e, grpc.aio.AioRpcError):
        err = AttemptFailed(f"{method}: {e.code().name}: {e.details()}")
        err.code = e.code().name
        return err
    if isinstance(e.__cause__, grpc.aio.AioRpcError):
        err = AttemptFailed(f"{method}: {e} (last: {e.__cause__.code().name}: {e.__cause__.details()})")
        err.code = e.__cause__.code().name
        return err
    return AttemptFailed(f"{method}: {e}")


def code_of(e: BaseException) -> str:
    return getattr(e, "code", "") if isinstance(getattr(e, "code", ""), str) else ""


class Client:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rng = random.Random(a.seed)
        random.seed(a.seed)               # the first replica choice too
        targets = a.targets.split(",")
        self.job = RawJob(a.job, targets, home=random.randrange(len(targets)), ttl=a.ttl,
                          rpc_timeout=a.rpc_timeout, log=log)
        self.rec = HistoryRecorder(a.history, name=f"client-{a.job}", job=a.job)
        self.groups = a.groups.split(",")
        self.fences = {g: FencedResource(fence_path(a, g)) for g in self.groups}
        self.accepted = {g: 0 for g in self.groups}
        self.stop = threading.Event()     # set by SIGTERM
        self._keepalive: asyncio.Task | None = None
        # with --sim-bytes / --coop-regions: the job's worker on the simulated GPU
        self.device: SimWorkerDevice | SimCoopWorkerDevice | None = None

    # -- the session ----------------------------------------------------------------------
    async def open_session(self) -> None:
        # ALREADY_EXISTS: our previous session (or an OpenSession whose reply was lost)
        # has not expired yet; it will within its TTL.
        await self.job.open(timeout=60.0, patient=True)
        self._keepalive = asyncio.create_task(self.job.keepalive_loop(self.a.ttl / 3))
        log(f"session open lease={self.job.lease:x} ttl={self.a.ttl}")

    def stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def close_session(self) -> None:
        self.stop_keepalive()
        await self.job.close_session()

    async def renew_session(self) -> None:
        """Drop the session (revoking it if it still lives) and open a new one."""
        if self.job.lost:
            self.stop_keepalive()
        else:
            await self.close_session()
        await self.open_session()
        if self.device is not None:
            await self.device.register()

    # -- one turn -------------------------------------------------------------------
    async def yield_(self, group: str, token: int) -> None:
        try:
            await self.job.yield_(group, token, timeout=self.a.acquire_timeout)
        except (grpc.aio.AioRpcError, GiveUp) as e:
            raise failure("Yield", e) from None

    async def turn(self) -> None:
        group = self.rng.choice(self.groups)
        # --priorities lo,hi: a class per turn (groups created with priority classes).
        cls = {"priority": self.rng.randint(*self.a.priorities)} if self.a.priorities else {}
        # --hint-mib lo,hi: a footprint per turn (fit groups), for a client with no device of its own;
        # --exclusive-p: the share of turns that ask for the GPUs alone.
        hint = self.device.footprint if self.device else \
            (self.rng.randint(*(int(x * MiB) for x in self.a.hint_mib)) if self.a.hint_mib else 0)
        excl = {"exclusive": True} if self.a.exclusive_p and self.rng.random() < self.a.exclusive_p else {}
        self.rec.acquire_req(group, **cls, **excl)
        try:
            rep = await self.job.acquire(group, timeout=self.a.acquire_timeout, hint=hint, **cls, **excl)
        except (grpc.aio.AioRpcError, GiveUp) as err:
            e = failure("Acquire", err)
            self.rec.error(group, str(e) or type(e).__name__, kind=type(e).__name__, code=code_of(e))
            # A fresh session: whatever lockd still keeps of this attempt goes with the old one.
            await self.renew_session()
            return
        token = rep.token
        self.rec.granted(group, token, epoch=rep.leader_epoch, waited_ms=round(rep.waited_ms, 1),
                         restored=rep.restored, elided=rep.elided, replica=self.job.answered_by,
                         footprint=dict(rep.footprint_bytes), exclusive=rep.exclusive, backfilled=rep.backfilled)
        fence = self.fences[group]
        if not fence.apply(self.rec, group, token):
            # Someone with a newer token has used the resource: our grant is stale.
            self.rec.error(group, "fenced off before entering", kind="Fenced", token=token)
            await self.quiet_yield(group, token)
            return
        self.accepted[group] += 1
        self.rec.cs_start(group, token)
        if self.device is not None:
            report = self.device.memory_report()      # before anything may wait for the device
            if report is not None:
                self.rec.record("memory", group=group, token=token, **report)
            await self.device.touch(group, token)
        await asyncio.sleep(self.rng.uniform(*self.a.cs_ms) / 1000)
        if fence.apply(self.rec, group, token):
            self.accepted[group] += 1
        self.rec.cs_end(group, token)
        try:
            await self.yield_(group, token)
        except (RawSessionLost, AttemptFailed) as e:
            self.rec.error(group, str(e) or type(e).__name__, kind=type(e).__name__, token=token, code=code_of(e))
            await self.renew_session()        # whatever lockd still holds for us goes with the old session
            return
        self.rec.yielded(group, token)

    async def quiet_yield(self, group: str, token: int) -> None:
        try:
            await self.yield_(group, token)
            log(f"stale grant {group}/{token}: Yield succeeded")
        except (RawSessionLost, AttemptFailed) as e:
            log(f"stale grant {group}/{token}: {e}")

    # -- the loop -------------------------------------------------------------------
    def run(self) -> int:
        return asyncio.run(self._run())

    async def _run(self) -> int:
        if self.a.coop_regions:
            self.device = SimCoopWorkerDevice(self.a, self.job, self.rec)
        elif self.a.sim_bytes:
            self.device = SimWorkerDevice(self.a, self.job, self.rec)
        await self.open_session()
        print(f"CLIENT_READY {self.a.job} {os.getpid()}", flush=True)
        end = time.monotonic() + self.a.duration
        turns = 0
        while not self.stop.is_set() and time.monotonic() < end:
            await self.turn()
            turns += 1
            await asyncio.sleep(self.rng.uniform(*self.a.think_ms) / 1000)
        for g in self.groups:
            self.fences[g].verify(self.rec, g, self.accepted[g])
        if self.device is not None:
            self.device.close()                 # the channel first, as the client library does
        await self.close_session()
        self.rec.close()
        await self.job.close()
        log(f"done: {turns} turns, replica moves {self.job.failovers}")
        return 0


def _range(s: str) -> tuple[float, float]:
    lo, _, hi = s.partition(",")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", required=True, help="lockd replicas, comma-separated host:port")
    p.add_argument("--job", required=True)
    p.add_argument("--groups", required=True, help="comma-separated group ids")
    p.add_argument("--history", required=True, help="history directory")
    p.add_argument("--fence-dir", required=True, help="directory of the fenced resources (one per group)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of turns; then finish and exit")
    p.add_argument("--ttl", type=int, default=3, help="session TTL, s")
    p.add_argument("--rpc-timeout", type=float, default=0.8, help="per-attempt deadline of short calls, s")
    p.add_argument("--acquire-timeout", type=float, default=45.0, help="give an acquire up after this, s")
    p.add_argument("--cs-ms", type=_range, default=(10.0, 40.0), help="critical section length lo,hi ms")
    p.add_argument("--think-ms", type=_range, default=(0.0, 20.0), help="pause between turns lo,hi ms")
    p.add_argument("--priorities", type=lambda s: tuple(int(x) for x in _range(s)), default=None,
                   help="ask each turn for a priority class drawn from lo,hi (groups with priority classes)")
    p.add_argument("--fit", action="store_true",
                   help="the groups have sharing fit: a fenced resource per job, not per group")
    p.add_argument("--hint-mib", type=_range, default=None,
                   help="declare a footprint drawn from lo,hi MiB on each acquire (no device of its own)")
    p.add_argument("--exclusive-p", type=float, default=0.0, help="share of turns that ask exclusive=True")
    p.add_argument("--sim-bytes", type=int, default=0, help="hold this many bytes on the simulated device")
    p.add_argument("--sim-dir", default=None, help="simulated device directory")
    p.add_argument("--coop-regions", default="", help="be a cooperative worker with these regions on the "
                   "simulated device: tag:bytes:offload|discard,... (see coopdevice.py)")
    p.add_argument("--agent-socket", default=None, help="the node agent's channel socket (cooperative worker)")
    p.add_argument("--node", default="node-a", help="node the simulated worker runs on")
    p.add_argument("--device-timeout", type=float, default=5.0,
                   help="a section whose device stays unusable this long fails its data check, s")
    p.add_argument("--library", action="store_true",
                   help="drive the public client library (timeslice.OrchestratorClient), see lib_client.py")
    p.add_argument("--etcd", default="", help="etcd endpoints: a library client asks etcd about its lease "
                   "when told the session is lost")
    p.add_argument("--error-pause", type=float, default=0.0,
                   help="library client: seconds to wait after a failed acquire before the next turn")
    a = p.parse_args(argv)
    if a.library:
        from chaos_tests.lib_client import LibClient

        client = LibClient(a)
    else:
        client = Client(a)
    signal.signal(signal.SIGTERM, lambda *_: client.stop.set())
    rc = client.run()
    # Done on its own (--duration): a SIGTERM the world sends now, as it finishes, must not kill the
    # exiting interpreter (it restores the default action of a Python handler at shutdown, and the
    # world then counts rc -15 as a crash). An ignored signal stays ignored through the shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return rc


if __name__ == "__main__":
    sys.exit(main())
