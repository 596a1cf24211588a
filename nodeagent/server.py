"""Serving a node agent: the intent loop, the direct gRPC API (with health), metrics, signals.

``serve`` prints ``NODEAGENT_READY port=N node=NAME backend=B`` once the agent
has rebuilt its picture, registered its liveness key and serves gRPC, so
launchers and tests that bind port 0 know where it is and that it is ready.
"""
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
from timeslice.common.server.etcd import ops
from timeslice.common.server.grpc_metrics import GrpcServerMetrics
from timeslice.common.server.serving import health_loop
from timeslice.nodeagent.agent import Agent
from timeslice.nodeagent.config import AgentConfig
from timeslice.nodeagent.direct import Operations
from timeslice.nodeagent.servicer import NodeAgentServicer
from timeslice.proto import nodeagent_pb2_grpc as pbg

log = structlog.get_logger(__name__)
SERVICE_NAME = "timeslice.v1.NodeAgent"


#: Methods that act on (or reveal) a job's processes: callers need the admin token.
ADMIN_METHODS = frozenset({"Snapshot", "Restore", "GetOperation"})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def authority_of(cfg: AgentConfig) -> Authority:
    a = Authority(load_admin_token(cfg.admin_token_file), cfg.insecure_no_admin_auth)
    if a.token is None:
        log.warning("direct_api_" + ("open" if a.insecure else "disabled"),
                    why="no admin token configured" + (" and --insecure-no-admin-auth given" if a.insecure
                                                       else "; Snapshot/Restore/GetOperation are refused"))
    return a


def direct_ops(agent: Agent) -> Operations:
    """The direct API's operations, on the agent's runner and reports (nodeagent/direct.py)."""
    return Operations(agent.node, agent.runner, agent.processes, agent.jobs, agent.reporter, agent.upkeep,
                      lambda: agent.stopping)


def create_server(agent: Agent, listen: str, operations: Operations | None = None,
                  health_servicer: health.aio.HealthServicer | None = None,
                  cfg: AgentConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Build the server and bind it (port 0: any free one); returns (server, bound port).

    ``cfg`` gives the credentials (admin token, TLS); without it the direct
    operations are refused (no token) and the port is plaintext.
    """
    authority = authority_of(cfg) if cfg is not None else Authority(None)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=[GrpcServerMetrics(agent.metrics.registry), Gate(authority, ADMIN_METHODS)])
    pbg.add_NodeAgentServicer_to_server(
        NodeAgentServicer(agent.upkeep, operations or direct_ops(agent), authority), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer or health.aio.HealthServicer(), server)
    if cfg is not None and cfg.tls_cert and cfg.tls_key is not None:     # config: cert and key come together
        creds = grpc.ssl_server_credentials(
            [(_read(cfg.tls_key), _read(cfg.tls_cert))],
            root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
            require_client_auth=bool(cfg.tls_client_ca))
        port = server.add_secure_port(listen, creds)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    return server, port


async def _etcd_ok(agent: Agent, timeout: float = 2.0) -> bool:
    try:
        await agent.client.range(ops.range_req(agent.keys.agent(agent.node), count_only=True), timeout=timeout)
        return agent.lease.alive()
    except Exception:
        return False


async def serve(cfg: AgentConfig, ready=None) -> None:
    # Opt-in traces (TIMESLICE_TRACING; exported per the OTEL_* variables): common/tracing.py.
    tracing.setup("nodeagent", {"timeslice.node": cfg.node})
    agent = Agent(cfg)
    operations = direct_ops(agent)
    hs = health.aio.HealthServicer()
    server, port = create_server(agent, cfg.listen, operations, hs, cfg)
    await agent.start(endpoint=cfg.endpoint(port))
    await server.start()
    if cfg.metrics_port >= 0:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=agent.metrics.registry)
    # SERVING while the agent can reach etcd with a live lease: only then can it
    # receive intents and report on them.
    health_task = asyncio.create_task(health_loop(
        hs, SERVICE_NAME, lambda: _etcd_ok(agent), lambda ok: agent.metrics.etcd_connected.set(1 if ok else 0)))
    log.info("serving", node=cfg.node, port=port, metrics_port=cfg.metrics_port, backend=agent.backend.name,
             simulated=agent.backend.name == "sim", listen=cfg.listen, tls=bool(cfg.tls_cert),
             mutual_tls=bool(cfg.tls_client_ca))
    # Machine-readable line for launchers and tests that bind port 0.
    logs.ready("NODEAGENT_READY", port=port, node=cfg.node, backend=agent.backend.name,
               metrics_port=cfg.metrics_port)
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping", node=cfg.node)
    agent.stopping = True
    health_task.cancel()
    await hs.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    # Ops in flight finish (a half-copied snapshot is never abandoned on purpose).
    await operations.stop(grace=30.0)
    await agent.stop()
    tracing.shutdown()
    log.info("stopped", node=cfg.node)
