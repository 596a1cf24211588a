"""The etcd connection every component uses: aetcd plus what it lacks.

aetcd connects to one host over plaintext. A lock service needs more: several
endpoints (so losing one etcd member is invisible), TLS with client
certificates, user/password auth, a deadline on every call, and a clear split
between "etcd is unreachable" and "this write may or may not have happened".
``EtcdClient`` subclasses ``aetcd.Client`` (so its KV/lease helpers keep
working) and owns the channel itself.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field

import grpc
import tenacity
from aetcd import Client as _AetcdClient
from aetcd import rpc

from timeslice.common.errors import ConfigError, EtcdUnavailable
from timeslice.common.server.etcd.errmap import map_error

# Client-side HTTP/2 keepalive finds a dead or paused member, so pick_first moves
# on to the next endpoint. etcd rejects pings more often than every 5 s by default.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    # gRPC >= 1.6x times an unanswered ping out by this one (default 60 s), not the above:
    # without it a paused member holds our calls for a minute.
    ("grpc.http2.ping_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. Validated when constructed."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    timeout: float = 5.0            # overall deadline of every unary call, seconds
    # Deadline of one attempt, seconds. While etcd elects a new raft leader a request
    # to a member without one hangs (a write's proposal is dropped, a linearizable read
    # waits for a leader) until the caller's deadline; etcd needs about one election
    # timeout (1 s by default) to have a leader again. So: a read is re-sent after this
    # long, within ``timeout``; a write that takes this long is reported as
    # OutcomeUnknown at once, for its caller to read and retry (docs/ARCHITECTURE.md, invariant 6).
    attempt_timeout: float = 1.5
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None      # TLS: CA bundle; setting it turns TLS on
    cert_file: str | None = None    # TLS client certificate (optional, with key_file)
    key_file: str | None = None
    extra_options: tuple = field(default=())

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("at least one etcd endpoint is required")
        for ep in self.endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"etcd endpoint {ep!r} is not host:port")
        if self.timeout <= 0 or self.attempt_timeout <= 0:
            raise ConfigError("etcd call timeouts must be > 0")
        if (self.username is None) != (self.password is None):
            raise ConfigError("etcd username and password go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("etcd client cert and key go together")
        if self.cert_file and not self.ca_file:
            raise ConfigError("etcd client certificates need --etcd-ca as well")

    @classmethod
    def parse(cls, endpoints: str, **kw) -> EtcdConfig:
        eps = tuple(e.strip().removeprefix("http://").removeprefix("https://")
                    for e in endpoints.split(",") if e.strip())
        return cls(endpoints=eps, **kw)


def _target(endpoints: tuple[str, ...]) -> tuple[str, str | None]:
    """A gRPC target that lists every member, and the TLS name to verify."""
    addrs: list[tuple[str, str]] = []
    names: list[str] = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            addrs.append((host, port))
        except ValueError:
            names.append(host)
            for info in socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP):
                addrs.append((str(info[4][0]), port))
    if not addrs:
        raise EtcdUnavailable(f"no address found for {endpoints}")
    v6 = any(":" in a for a, _ in addrs)
    scheme = "ipv6" if v6 else "ipv4"
    fmt = (lambda a, p: f"[{a}]:{p}") if v6 else (lambda a, p: f"{a}:{p}")
    uniq = list(dict.fromkeys(fmt(a, p) for a, p in addrs))
    return f"{scheme}:{','.join(uniq)}", (names[0] if names else None)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class EtcdClient(_AetcdClient):
    """aetcd client over a multi-endpoint, optionally TLS, channel."""

    def __init__(self, config: EtcdConfig):
        super().__init__(
            username=config.username, password=config.password, timeout=config.timeout,
        )
        self.config = config

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target, tls_name = _target(self.config.endpoints)
        options = list(_CHANNEL_OPTIONS) + list(self.config.extra_options)
        if self.config.ca_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.config.ca_file),
                private_key=_read(self.config.key_file),
                certificate_chain=_read(self.config.cert_file),
            )
            if tls_name:
                options.append(("grpc.ssl_target_name_override", tls_name))
            self.channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        if self._username is not None:
            stub = rpc.AuthStub(self.channel)
            try:
                resp = await stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as e:
                raise map_error(e, write=False) from e
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self.watchstub = rpc.WatchStub(self.channel)
        self._connected.set()

    def watch_metadata(self) -> tuple:
        # "hasleader" makes etcd cancel our watch when its member loses the raft
        # leader, instead of leaving us on a member that can no longer see writes.
        return (*(self.metadata or ()), ("hasleader", "true"))

    # --- raw calls with our error mapping -------------------------------------
    @property
    def attempt_timeout(self) -> float:
        return min(self.config.attempt_timeout, self._timeout)

    async def txn(self, compare, success=(), failure=(), *, timeout: float | None = None):
        """One etcd transaction; returns the raw TxnResponse.

        A deadline or unavailability *after* the request may have been sent is
        reported as OutcomeUnknown: the caller must read to learn what happened.
        Without an explicit ``timeout`` a write waits ``attempt_timeout`` (it is
        not re-sent: only its caller knows whether that is safe).
        """
        await self.connect()
        req = rpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        write = bool(success or failure)
        t = timeout or (self.attempt_timeout if write else self._timeout)
        try:
            return await self.kvstub.Txn(req, timeout=t, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise map_error(e, write=write) from e

    async def range(self, request: rpc.RangeRequest, *, timeout: float | None = None):
        """A linearizable Range; returns the raw RangeResponse.

        Idempotent, so an attempt that gets no answer within ``attempt_timeout``
        (a member between raft leaders) is re-sent, with jittered backoff, until
        ``timeout`` (default: the client's) has passed.
        """
        await self.connect()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self._timeout)

        async def once():
            left = deadline - loop.time()
            try:
                return await self.kvstub.Range(request, timeout=max(0.01, min(self.attempt_timeout, left)),
                                               metadata=self.metadata)
            except grpc.aio.AioRpcError as e:
                raise map_error(e, write=False) from e

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(EtcdUnavailable),
            wait=tenacity.wait_random_exponential(multiplier=0.02, max=0.5),
            stop=lambda _state: loop.time() >= deadline, reraise=True)
        return await retrying(once)

    async def grant_lease(self, ttl: int) -> tuple[int, int]:
        """Grant a lease; returns (lease_id, granted_ttl)."""
        await self.connect()
        try:
            r = await self.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), timeout=self._timeout,
                                                metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise map_error(e, write=False) from e
        return r.ID, r.TTL

    async def keepalive_once(self, lease_id: int, timeout: float | None = None) -> int:
        """Refresh a lease once; returns the TTL etcd reports (<= 0: the lease is gone)."""
        await self.connect()

        async def one() -> int:
            # write/read, not a request iterator: grpc.aio runs an iterator in a task of
            # its own that a cancelled call can leave pending ("Task was destroyed").
            call = self.leasestub.LeaseKeepAlive(metadata=self.metadata)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await call.read()
                return 0 if reply is grpc.aio.EOF else reply.TTL
            finally:
                call.cancel()

        async def attempt(t: float) -> int:
            try:
                return await asyncio.wait_for(one(), t)
            except asyncio.TimeoutError as e:
                raise EtcdUnavailable("lease keepalive timed out") from e
            except grpc.aio.AioRpcError as e:
                raise map_error(e, write=False) from e

        if timeout is not None:
            return await attempt(timeout)       # one attempt: the caller runs its own loop
        # A renewal is idempotent: re-send short attempts until the client's deadline.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(EtcdUnavailable),
            wait=tenacity.wait_random_exponential(multiplier=0.02, max=0.5),
            stop=lambda _state: loop.time() >= deadline, reraise=True)

        async def short() -> int:
            return await attempt(max(0.01, min(self.attempt_timeout, deadline - loop.time())))

        return await retrying(short)

    async def revoke(self, lease_id: int) -> int:
        """Revoke a lease; returns the revision its keys went at, 0 if it was already gone (which
        counts as revoked)."""
        await self.connect()
        try:
            r = await self.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=self._timeout,
                                                 metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise map_error(e, write=False) from e
        return r.header.revision
