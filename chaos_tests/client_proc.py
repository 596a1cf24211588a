"""A chaos client: one job in its own OS process, looping acquire → fenced section → yield.

    python -m chaos_tests.client_proc --targets h:p,h:p,h:p --job c1 --groups g0,g1 \
        --history DIR --fence-dir DIR --seed 7 --duration 20

Each turn picks a group, asks for it, and once granted *claims* the shared
resource (``FencedResource``, one file per group) with its token before
entering the critical section, and ends the section with a second fenced
operation: a holder that lost its lock (a pause past its session TTL) is
then stopped by the fence, and the checker sees exactly where. Everything is
recorded with ``HistoryRecorder``; the checker judges the merged history.

It speaks raw gRPC (``tsproto``) with a small failover policy of its own, so
that what the history shows is what lockd answered, not what a library made
of it:

* KeepAlive every ttl/3 to the current replica; a replica that does not
  answer within ``--rpc-timeout`` (killed, paused, cut off from etcd) is left
  for the next one.
* Acquire is sent without a short deadline (a deadline that expires makes
  lockd give up the waiter's place). When its replica is left, the Acquire is
  re-sent to the next one *and the first call is left running*: the re-sent
  one finds the same queue entry (same token), and cancelling the first would
  delete it.
* Yield is re-sent with the same token after UNAVAILABLE / DEADLINE_EXCEEDED;
  ``not_queued`` on a re-sent Yield means the earlier one applied.
* ABORTED means the session is gone: the attempt is recorded as an ``error``,
  and a new session is opened under the same job id.

With ``--sim-bytes`` the process is also the job's GPU worker on the
SIMULATED device (``nodeagent.sim``): it allocates an arena, registers itself
with lockd as the job's worker on ``--node``, and inside every critical
section checks that its device bytes are exactly what it left there (the node
agent may have snapshotted and restored them in between), recording a
``data_check``, then changes them.

On SIGTERM, or after ``--duration`` seconds, it finishes its current turn,
records a ``data_check`` per group (the resource kept every operation it
accepted from this job), closes its session and exits 0.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import threading
import time

import grpc
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg

from chaos_tests.history import FencedResource, HistoryRecorder

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SessionLost(Exception):
    """lockd answered ABORTED (or the session could not be used any more)."""


class AttemptFailed(Exception):
    """The attempt ended with an explicit error other than session loss."""


def log(msg: str) -> None:
    print(f"{time.monotonic():.3f} {msg}", file=sys.stderr, flush=True)


class Replicas:
    """Stubs for every lockd replica and the index of the one in use."""

    def __init__(self, targets: list[str], rpc_timeout: float):
        self.targets = targets
        self.rpc_timeout = rpc_timeout
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.stubs = [pbg.LockdStub(c) for c in self.channels]
        self.cur = random.randrange(len(targets))
        self.moves = 0
        self._mu = threading.Lock()

    def leave(self, idx: int, why: str) -> None:
        """Move off replica ``idx`` (if it is still the current one)."""
        with self._mu:
            if self.cur == idx:
                self.cur = (idx + 1) % len(self.targets)
                self.moves += 1
                log(f"leave replica {self.targets[idx]} ({why}) -> {self.targets[self.cur]}")

    def unary(self, method: str, req, timeout: float | None = None, tries: int | None = None):
        """One call with failover on UNAVAILABLE/DEADLINE: (reply, resent)."""
        tries = tries or 2 * len(self.targets)
        resent = False
        for i in range(tries):
            idx = self.cur
            try:
                return getattr(self.stubs[idx], method)(req, timeout=timeout or self.rpc_timeout), resent
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or i == tries - 1:
                    raise
                self.leave(idx, f"{method}: {e.code().name}")
                resent = True
                time.sleep(0.05 * i)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for c in self.channels:
            c.close()


class Session:
    """The job's session: secret, and a keepalive thread that follows the replicas."""

    def __init__(self, reps: Replicas, job: str, ttl: int):
        self.reps, self.job, self.ttl = reps, job, ttl
        self.secret = ""
        self.lost = threading.Event()
        self.lost_reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, deadline_s: float = 60.0) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                r, _ = self.reps.unary("OpenSession", pb.OpenSessionRequest(job_id=self.job, ttl_seconds=self.ttl))
                break
            except grpc.RpcError as e:
                # ALREADY_EXISTS: our previous session (or an OpenSession whose
                # reply was lost) has not expired yet; it will within its TTL.
                if time.monotonic() > deadline:
                    raise
                log(f"open session: {e.code().name} {e.details()}")
                time.sleep(0.3)
        self.secret = r.session_secret
        self.lost.clear()
        self.lost_reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, args=(self._stop, self.secret), daemon=True)
        self._thread.start()
        log(f"session open lease={r.lease_id:x} ttl={r.ttl_seconds}")

    def _keepalive(self, stop: threading.Event, secret: str) -> None:
        period = self.ttl / 3
        while not stop.wait(period):
            for _ in range(len(self.reps.targets)):
                idx = self.reps.cur
                try:
                    self.reps.stubs[idx].KeepAlive(pb.SessionRef(job_id=self.job, session_secret=secret),
                                                   timeout=self.reps.rpc_timeout)
                    break
                except grpc.RpcError as e:
                    if e.code() in RETRYABLE:
                        self.reps.leave(idx, f"KeepAlive: {e.code().name}")
                        continue
                    if stop.is_set():
                        return
                    if e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAUTHENTICATED):
                        self.mark_lost(f"KeepAlive: {e.code().name} {e.details()}")
                        return
                    log(f"keepalive: {e.code().name} {e.details()}")
                    break

    def mark_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
            log(f"session lost: {reason}")

    def stop_keepalive(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop_keepalive()
        try:
            self.reps.unary("CloseSession", pb.SessionRef(job_id=self.job, session_secret=self.secret))
        except grpc.RpcError as e:
            log(f"close session: {e.code().name}")


class Client:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rng = random.Random(a.seed)
        random.seed(a.seed)               # the first replica choice too
        self.reps = Replicas(a.targets.split(","), a.rpc_timeout)
        self.rec = HistoryRecorder(a.history, name=f"client-{a.job}", job=a.job)
        self.groups = a.groups.split(",")
        self.fences = {g: FencedResource(os.path.join(a.fence_dir, f"fence-{g}.json")) for g in self.groups}
        self.accepted = {g: 0 for g in self.groups}
        self.session = Session(self.reps, a.job, a.ttl)
        self.stop = threading.Event()
        self.dev = None
        self.expected_sha = ""
        self.device_lost = False
        self.seq = 0                      # AcquireRequest.attempt_seq of the last send

    # -- the simulated GPU (only with --sim-bytes) -------------------------------
    def setup_device(self) -> None:
        """Register this process on the node's simulated device; the arena comes with the first grant."""
        from timeslice.nodeagent.sim.client import SimDeviceClient

        self.dev = SimDeviceClient.open(self.a.sim_dir)

    def register_worker(self) -> None:
        """Tell lockd this process holds the job's device memory (once it does)."""
        if not self.expected_sha:
            return
        self.reps.unary("RegisterWorker", pb.WorkerRequest(
            job_id=self.a.job, session_secret=self.session.secret, node=self.a.node, pid=os.getpid(),
            device_bytes=self.a.sim_bytes))

    def first_fill(self, group: str, token: int) -> None:
        """First grant: the scheduler made room; allocate, fill, and tell lockd about it.

        The section lasts until the node agent reports the allocation (free
        device memory dropped by our bytes), as a job's first phase would keep
        the GPU while loading: the leader decides later swaps from that report.
        """
        self.dev.alloc(self.a.sim_bytes, timeout_s=self.a.device_timeout)
        data = random.Random(self.a.seed).randbytes(self.a.sim_bytes)
        with self.dev.compute(timeout_s=self.a.device_timeout) as mem:
            mem[:] = data
        self.expected_sha = hashlib.sha256(data).hexdigest()
        del data
        self.register_worker()
        deadline = time.monotonic() + self.a.device_timeout
        while time.monotonic() < deadline:
            try:
                st, _ = self.reps.unary("GetGroupStatus", pb.GroupRef(group_id=group))
                ns = next((n for n in st.node_status if n.node == self.a.node), None)
                if ns is not None and ns.agent_alive and ns.device_free_bytes <= ns.device_total_bytes - self.a.sim_bytes:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        log(f"agent did not report our {self.a.sim_bytes} bytes within {self.a.device_timeout}s")

    def touch_device(self, group: str, token: int) -> None:
        """Check that the device bytes survived since our last section, then change them."""
        if not self.expected_sha:
            self.first_fill(group, token)
            return
        if self.device_lost:
            return
        try:
            with self.dev.compute(timeout_s=self.a.device_timeout) as mem:
                # Touching a mapping whose file shrank would kill us with SIGBUS:
                # look first, so that a lost context is a recorded failure, not a crash.
                size = os.path.getsize(self.dev.dev.arena(self.dev.pid))
                if size < self.a.sim_bytes:
                    self.device_lost = True
                    self.rec.data_check(group, False, f"device memory gone: the arena holds {size} of "
                                        f"{self.a.sim_bytes} bytes in a granted section", token=token)
                    return
                got, want = hashlib.sha256(mem).hexdigest(), self.expected_sha
                ok = got == want
                stamp = f"{self.a.job}:{token}".encode().ljust(32, b".")
                off = (token * 4099) % (len(mem) - 32)
                mem[off:off + 32] = stamp
                self.expected_sha = hashlib.sha256(mem).hexdigest()
            self.rec.data_check(group, ok, "device bytes intact" if ok else
                                f"device sha256 {got[:16]} != expected {want[:16]}", token=token)
        except TimeoutError as e:
            # The grant came while our context was not on the device.
            self.rec.data_check(group, False, f"device not usable {self.a.device_timeout}s into the "
                                f"section: {e}", token=token)

    # -- one turn -------------------------------------------------------------------
    def acquire(self, group: str) -> tuple[int, pb.AcquireReply]:
        req = pb.AcquireRequest(job_id=self.a.job, session_secret=self.session.secret, group_id=group,
                                device_bytes_hint=self.a.sim_bytes)
        deadline = time.monotonic() + self.a.acquire_timeout
        calls: list[tuple[int, grpc.Future]] = []
        try:
            while True:
                if self.session.lost.is_set():
                    raise SessionLost(self.session.lost_reason)
                for idx, fut in list(calls):
                    if not fut.done():
                        continue
                    calls.remove((idx, fut))
                    try:
                        return idx, fut.result()
                    except grpc.RpcError as e:
                        code = e.code()
                        if code in RETRYABLE or code == grpc.StatusCode.CANCELLED:
                            self.reps.leave(idx, f"Acquire: {code.name}")
                        elif code == grpc.StatusCode.ABORTED:
                            self.session.mark_lost(f"Acquire: {e.details()}")
                            raise SessionLost(e.details()) from None
                        else:
                            raise AttemptFailed(f"Acquire: {code.name}: {e.details()}") from None
                if not any(idx == self.reps.cur for idx, _ in calls):
                    # Send (again) to the current replica; earlier calls stay running.
                    # Each send is numbered: lockd lets a late, older one change nothing.
                    idx = self.reps.cur
                    self.seq += 1
                    req.attempt_seq = self.seq
                    calls.append((idx, self.reps.stubs[idx].Acquire.future(
                        req, timeout=self.a.acquire_timeout + 30)))
                if time.monotonic() > deadline:
                    raise AttemptFailed(f"Acquire: not granted within {self.a.acquire_timeout}s")
                time.sleep(0.005)
        except BaseException:
            # The attempt failed: withdraw every copy of it (the caller also drops the session).
            for _, fut in calls:
                fut.cancel()
            raise

    def yield_(self, group: str, token: int) -> None:
        req = pb.YieldRequest(job_id=self.a.job, session_secret=self.session.secret, group_id=group, token=token)
        deadline = time.monotonic() + self.a.acquire_timeout
        resent = False
        while True:
            idx = self.reps.cur
            try:
                self.reps.stubs[idx].Yield(req, timeout=self.a.rpc_timeout * 2)
                return
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code in RETRYABLE:
                    self.reps.leave(idx, f"Yield: {code.name}")
                    resent = True
                    if time.monotonic() > deadline:
                        raise AttemptFailed(f"Yield: outcome unknown after {self.a.acquire_timeout}s") from None
                    time.sleep(0.05)
                    continue
                if code == grpc.StatusCode.FAILED_PRECONDITION and "not_queued" in details and resent:
                    return                        # the earlier Yield applied
                if code == grpc.StatusCode.ABORTED:
                    self.session.mark_lost(f"Yield: {details}")
                    raise SessionLost(details) from None
                raise AttemptFailed(f"Yield: {code.name}: {details}") from None

    def turn(self) -> None:
        group = self.rng.choice(self.groups)
        self.rec.acquire_req(group)
        try:
            idx, rep = self.acquire(group)
        except (SessionLost, AttemptFailed) as e:
            self.rec.error(group, str(e) or type(e).__name__, kind=type(e).__name__)
            # A fresh session: whatever lockd still keeps of this attempt goes with the old one.
            self.renew_session()
            return
        token = rep.token
        self.rec.granted(group, token, epoch=rep.leader_epoch, waited_ms=round(rep.waited_ms, 1),
                         restored=rep.restored, elided=rep.elided, replica=self.reps.targets[idx])
        fence = self.fences[group]
        if not fence.apply(self.rec, group, token):
            # Someone with a newer token has used the resource: our grant is stale.
            self.rec.error(group, "fenced off before entering", kind="Fenced", token=token)
            self.quiet_yield(group, token)
            return
        self.accepted[group] += 1
        self.rec.cs_start(group, token)
        if self.dev is not None:
            self.touch_device(group, token)
        time.sleep(self.rng.uniform(*self.a.cs_ms) / 1000)
        if fence.apply(self.rec, group, token):
            self.accepted[group] += 1
        self.rec.cs_end(group, token)
        try:
            self.yield_(group, token)
        except (SessionLost, AttemptFailed) as e:
            self.rec.error(group, str(e) or type(e).__name__, kind=type(e).__name__, token=token)
            self.renew_session()              # whatever lockd still holds for us goes with the old session
            return
        self.rec.yielded(group, token)

    def quiet_yield(self, group: str, token: int) -> None:
        try:
            self.yield_(group, token)
            log(f"stale grant {group}/{token}: Yield succeeded")
        except (SessionLost, AttemptFailed) as e:
            log(f"stale grant {group}/{token}: {e}")

    def renew_session(self) -> None:
        """Drop the session (revoking it if it still lives) and open a new one."""
        if self.session.lost.is_set():
            self.session.stop_keepalive()
        else:
            self.session.close()
        self.session.open()
        if self.dev is not None:
            self.register_worker()

    # -- the loop -------------------------------------------------------------------
    def run(self) -> int:
        if self.a.sim_bytes:
            self.setup_device()
        self.session.open()
        print(f"CLIENT_READY {self.a.job} {os.getpid()}", flush=True)
        end = time.monotonic() + self.a.duration
        turns = 0
        while not self.stop.is_set() and time.monotonic() < end:
            self.turn()
            turns += 1
            time.sleep(self.rng.uniform(*self.a.think_ms) / 1000)
        for g in self.groups:
            self.fences[g].verify(self.rec, g, self.accepted[g])
        self.session.close()
        self.rec.close()
        self.reps.close()
        log(f"done: {turns} turns, replica moves {self.reps.moves}")
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
    p.add_argument("--sim-bytes", type=int, default=0, help="hold this many bytes on the simulated device")
    p.add_argument("--sim-dir", default=None, help="simulated device directory")
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
    return client.run()


if __name__ == "__main__":
    sys.exit(main())
