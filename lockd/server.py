"""Serving a replica: gRPC (with health), metrics, signals, graceful stop."""
from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import start_http_server

from timeslice.common import tracing
from timeslice.common.server import logs
from timeslice.common.server.auth import Authority, Gate, load_admin_token
from timeslice.common.server.grpc_metrics import GrpcServerMetrics
from timeslice.common.server.serving import health_loop
from timeslice.lockd.callers import Callers
from timeslice.lockd.config import LockdConfig
from timeslice.lockd.replica import Replica
from timeslice.lockd.servicer import LockdServicer
from timeslice.proto import lockd_pb2_grpc as pbg

log = structlog.get_logger(__name__)
SERVICE_NAME = "timeslice.v1.Lockd"
# Clients ping every second while a call is open (timeslice.config.KEEPALIVE_TIME_MS),
# to leave a paused replica quickly; gRPC's defaults would answer such pings on a
# blocked Acquire (no data for minutes) with GOAWAY "too_many_pings".
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]
#: Methods that change what other jobs see (groups): they need the admin token.
ADMIN_METHODS = frozenset({"CreateGroup", "DeleteGroup"})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def create_server(config: LockdConfig, replica: Replica) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build the server and bind it; returns (server, bound port, health servicer)."""
    authority = Authority(load_admin_token(config.admin_token_file), config.insecure_no_admin_auth)
    if authority.token is None:
        log.warning("admin_calls_" + ("open" if authority.insecure else "disabled"),
                    why="no admin token configured" + (" and --insecure-no-admin-auth given" if authority.insecure
                                                       else "; CreateGroup/DeleteGroup are refused"))
    tenants = config.callers.tenant_book()
    # With tenants, a tenant that administers a group may delete it: the servicer decides (lockd/tenancy.py).
    gated = ADMIN_METHODS - {"DeleteGroup"} if tenants is not None else ADMIN_METHODS
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[GrpcServerMetrics(replica.metrics.registry), Gate(authority, gated)])
    pbg.add_LockdServicer_to_server(LockdServicer(replica, Callers(authority, config.callers, tenants)), server)
    if tenants is not None:
        log.info("tenancy_on", tenants=sorted(tenants.tenants), tenants_file=config.callers.tenants_file)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.tls_cert and config.tls_key is not None:     # config: cert and key come together
        ca = config.callers.tls_client_ca
        # With a client CA, every caller proves a certificate identity (lockd/callers.py).
        creds = grpc.ssl_server_credentials([(_read(config.tls_key), _read(config.tls_cert))],
                                            root_certificates=_read(ca) if ca else None,
                                            require_client_auth=ca is not None)
        port = server.add_secure_port(config.listen, creds)
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    return server, port, health_servicer


async def serve(config: LockdConfig, ready=None) -> None:
    # Opt-in traces (TIMESLICE_TRACING; exported per the OTEL_* variables): common/tracing.py.
    tracing.setup("lockd", {"timeslice.replica": config.replica_id})
    replica = Replica(config)
    await replica.start()
    server, port, hs = create_server(config, replica)
    await server.start()
    if config.metrics_port >= 0:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=replica.metrics.registry)
    # SERVING only while this replica can reach etcd: a load balancer then sends
    # clients to replicas that can actually answer them.
    health_task = asyncio.create_task(health_loop(
        hs, SERVICE_NAME, replica.etcd_healthy, lambda ok: replica.metrics.etcd_connected.set(1 if ok else 0)))
    log.info("serving", replica=config.replica_id, port=port, metrics_port=config.metrics_port,
             tls=bool(config.tls_cert))
    # Machine-readable line for launchers and tests that bind port 0.
    logs.ready("LOCKD_READY", port=port, replica=config.replica_id, metrics_port=config.metrics_port)
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping", replica=config.replica_id)
    health_task.cancel()
    await hs.enter_graceful_shutdown()
    # Resign before draining: the next replica takes over while we finish.
    await replica.leader.resign()
    await server.stop(grace=2.0)
    await replica.stop()
    tracing.shutdown()
    log.info("stopped", replica=config.replica_id)
