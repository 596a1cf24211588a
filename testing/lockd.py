"""Real lockd replicas as processes, for tests, chaos scenarios and benchmarks.

Each replica is the launcher's ``LockdReplica`` (``python -m timeslice.lockd.cli serve``
on a free loopback port, logging JSON to its own file) with the harness's
faults: stopped (SIGTERM: graceful, resigns), killed (SIGKILL), paused and
resumed, restarted (see testing/server.py).
"""
from __future__ import annotations

import os
import secrets
import tempfile
import time

import grpc

from timeslice.common.server.auth import ENV_ADMIN_TOKEN
from timeslice.launcher.servers import Launch, LockdReplica, read_leader
from timeslice.testing.procs import terminate
from timeslice.testing.server import ServerProcess


class LockdProcess(ServerProcess, LockdReplica):
    """A lockd replica on a free loopback port (``listen_port`` fixes one), metrics off."""

    NAME = "lockd"

    def __init__(self, endpoints: str, prefix: str, replica_id: str, logdir: str, extra: list[str],
                 listen_port: int = 0, env: dict[str, str] | None = None):
        shared_admin_token()
        super().__init__(replica_id, endpoints, prefix, os.path.join(logdir, f"lockd-{replica_id}.log"),
                         Launch(listen_port=listen_port, extra=extra, env=dict(env or {})))


def shared_admin_token() -> str:
    """The admin token of everything this process starts: $TIMESLICE_ADMIN_TOKEN, set to a fresh random
    one when unset, so lockd replicas and agents (children inherit it) and this process's clients agree."""
    return os.environ.setdefault(ENV_ADMIN_TOKEN, secrets.token_urlsafe(24))


class LockdCluster:
    """``n`` replicas against one etcd (cluster) and one key prefix."""

    def __init__(self, etcd_endpoints: str, prefix: str, n: int = 3, logdir: str | None = None,
                 extra: list[str] | None = None):
        self.logdir = logdir or tempfile.mkdtemp(prefix="lockd-")
        self.etcd_endpoints, self.prefix = etcd_endpoints, prefix
        self.replicas = [LockdProcess(etcd_endpoints, prefix, f"r{i}", self.logdir, extra or [])
                         for i in range(n)]

    def start(self) -> LockdCluster:
        for r in self.replicas:
            r.start()
        return self

    def stop(self) -> None:
        for r in self.replicas:
            r.resume() if r.alive() else None
        terminate([r.proc for r in self.replicas if r.proc is not None], 10.0)

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self.replicas if r.alive()]

    def by_id(self, replica_id: str) -> LockdProcess:
        return next(r for r in self.replicas if r.replica_id == replica_id)

    def leader(self, etcd, timeout: float = 15.0) -> tuple[LockdProcess, int]:
        """(leading replica, epoch), read from the election keys in etcd (its running members)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = read_leader([m.client_port for m in etcd.members if m.is_running() and not m.paused],
                                self.prefix)
            if found:
                rep = self.by_id(found["replica"])
                if rep.alive():
                    return rep, found["epoch"]
            time.sleep(0.1)
        raise TimeoutError("no lockd leader elected")

    def dump_logs(self, n: int = 40) -> str:
        return "\n".join(f"--- {r.replica_id} ---\n{r.log_tail(n)}" for r in self.replicas)



class _Bearer:
    def __init__(self, token: str):
        self.md = ("authorization", f"Bearer {token}")

    def _details(self, d):
        md = grpc.aio.Metadata(*(d.metadata or ()), self.md)
        return d._replace(metadata=md) if hasattr(d, "_replace") else \
            grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


# Two classes, not one with both bases: grpc.aio files an interceptor under the first kind it
# is an instance of, so one class of both kinds would never see a stream (WatchGroup).
class _BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def admin_channel(target: str, token: str | None = None) -> grpc.aio.Channel:
    """A plaintext aio channel whose every call carries the admin token (for tests' raw stubs)."""
    token = token or shared_admin_token()
    return grpc.aio.insecure_channel(target, interceptors=[_BearerUnary(token), _BearerStream(token)])
