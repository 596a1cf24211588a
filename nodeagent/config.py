"""The node agent's configuration: flags, environment, defaults, validated at start-up.

Every flag can also be set as TIMESLICE_<FLAG> in the environment (dashes
become underscores: --etcd-endpoints = TIMESLICE_ETCD_ENDPOINTS); a flag on
the command line wins. ``--node`` also falls back to TIMESLICE_NODE_NAME (what
the DaemonSet sets from spec.nodeName) and then to the host name. The
simulator's flags share their variables with the simulator itself
(TIMESLICE_SIM_DIR, TIMESLICE_SIM_CAPACITY_BYTES, ...), so a worker started
with the same environment finds the same device.
"""
from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass, field

from timeslice.common import defaults as D
from timeslice.common.errors import ConfigError
from timeslice.common.ids import check_id
from timeslice.common.server.auth import load_admin_token
from timeslice.common.server.etcd.client import EtcdConfig
from timeslice.common.server.etcd.timing import SessionTiming
from timeslice.common.server.keys import Keys
from timeslice.common.server.serving import add_etcd_flags, env_flag, etcd_config
from timeslice.common.server.serving import parse_bool as _bool
from timeslice.nodeagent.backends.ops import DEFAULT_LOCK_TIMEOUT_MS
from timeslice.nodeagent.backends.records import DEFAULT_STATE_DIR, ENV_STATE_DIR
from timeslice.nodeagent.hostmem import DEFAULT_HOST_RESERVE_BYTES
from timeslice.nodeagent.reconnects import DEFAULT_RECONNECT_GRACE_S

# Accepted --backend values; "cuda-checkpoint" is the tool's own name for "cuda-cli".
BACKENDS = ("auto", "cuda-driver", "cuda-checkpoint", "cuda-cli", "sim")
_ALIASES = {"cuda-checkpoint": "cuda-cli"}


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``serve`` needs. Defaults are the production ones.

    refresh_interval: seconds between refreshes of the liveness key's figures
        (free memory, resident jobs); it is also rewritten after every op, in
        the op's own status transaction. Default 2 s.
    session: the agent's lease; the leader declares a node's agent dead once
        its key is gone, i.e. at most ``ttl`` (default 10 s) after the agent died.
    lock_timeout_ms: how long a checkpoint lock may wait for the job's queued
        GPU work before the snapshot fails (process left running). Default 10 s.
    reconnect_grace_s: how long an op waits for a cooperative worker with no
        channel to this agent (not reconnected since the agent started, or
        closing on its way out) to come back or exit, before it fails with the
        reason (nodeagent/reconnects.py). Default 20 s: a live worker retries
        within ~3 s. Keep it well below lockd's --swap-timeout (120 s), or the
        waiter is failed for the agent's silence instead of told why.
    """

    node: str
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    prefix: str = D.KEY_PREFIX
    listen: str = f"127.0.0.1:{D.NODEAGENT_PORT}"   # loopback unless told: the direct API is for this host
    advertise: str = ""                       # endpoint written in the agent key; "" = derived
    metrics_port: int = D.NODEAGENT_METRICS_PORT   # -1: no metrics endpoint
    metrics_host: str = "0.0.0.0"                  # address the metrics endpoint binds (pod IP / 127.0.0.1)
    backend: str = "auto"
    state_dir: str = DEFAULT_STATE_DIR
    host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
    refresh_interval: float = 2.0
    session: SessionTiming = field(default_factory=SessionTiming)
    sim_dir: str | None = None
    sim_capacity_bytes: int | None = None
    sim_checkpoint_gbps: float | None = None
    sim_restore_gbps: float | None = None
    admin_token_file: str | None = None       # None: $TIMESLICE_ADMIN_TOKEN, else the direct ops are refused
    insecure_no_admin_auth: bool = False      # direct ops open to any caller: throw-away test setups only
    tls_cert: str | None = None               # serve the direct API over TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None          # and require client certificates signed by this CA (mutual TLS)
    log_level: str = "info"
    channel_socket: str = ""                  # cooperative workers' Unix socket; "" = default_socket_path(node)
    swap_deadline_s: float = 120.0            # a cooperative worker / app server must answer within this
    reconnect_grace_s: float = DEFAULT_RECONNECT_GRACE_S   # an unreachable cooperative worker is waited for so long
    app_drain_s: float = 0.0                  # an app server's in-flight requests may finish this long; 0: half
    app_drain_expired: str = "refuse"         # then: refuse the swap (serve on) or abort them (app_endpoint.py)
    freeze_parked: bool = False               # lock a paused cooperative worker (see backends/composite.py)
    parked_warn_s: float = 300.0              # warn once when a job stays snapshotted (parked) this long
    require_attestation: bool = False         # act only on pids a job attested over the channel (attestations.py)

    def __post_init__(self) -> None:
        check_id("node", self.node)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        load_admin_token(self.admin_token_file)      # a bad token file fails start-up
        Keys(self.prefix)                      # raises on a malformed prefix
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        for name, addr in (("--listen", self.listen), ("--advertise", self.advertise)):
            host, _, port = addr.rpartition(":")
            if addr and (not host or not port.isdigit()):
                raise ConfigError(f"{name} {addr!r} is not host:port")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"--log-level {self.log_level!r}: debug, info, warning or error")
        if self.host_reserve_bytes < 0:
            raise ConfigError("--host-reserve-bytes must be >= 0")
        if self.lock_timeout_ms <= 0:
            raise ConfigError("--lock-timeout-ms must be > 0: an unbounded lock can wedge the agent")
        if not 0 < self.refresh_interval < self.session.ttl:
            raise ConfigError(f"--refresh-interval must be in (0, session ttl {self.session.ttl}s)")
        if self.parked_warn_s <= 0:
            raise ConfigError("--parked-warn-s must be > 0")
        if not 0 < self.swap_deadline_s <= 3600:
            raise ConfigError("--swap-deadline-s must be in (0, 3600]")
        if not 0 < self.reconnect_grace_s <= 600:
            raise ConfigError("--reconnect-grace-s must be in (0, 600]: a waiter must learn why in bounded time")
        if not 0 <= self.app_drain_s < self.swap_deadline_s:
            raise ConfigError("--app-drain-s must be in [0, --swap-deadline-s) (0: half the swap deadline)")
        if self.app_drain_expired not in ("refuse", "abort"):
            raise ConfigError(f"--app-drain-expired {self.app_drain_expired[:16]!r}: refuse or abort")
        if self.sim_capacity_bytes is not None and self.sim_capacity_bytes <= 0:
            raise ConfigError("--sim-capacity-bytes must be > 0")
        for name, v in (("--sim-checkpoint-gbps", self.sim_checkpoint_gbps),
                        ("--sim-restore-gbps", self.sim_restore_gbps)):
            if v is not None and v < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = unthrottled)")

    @property
    def backend_name(self) -> str:
        """The name ``pick_backend`` knows."""
        return _ALIASES.get(self.backend, self.backend)

    def endpoint(self, port: int) -> str:
        """Where other components reach this agent's gRPC API."""
        if self.advertise:
            return self.advertise
        host = self.listen.rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"{host}:{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--node", D.ENV_NODE_NAME, default=None, help="this node's name (default: host name)")
    add_etcd_flags(p)
    env_flag(p, "--listen", default=f"127.0.0.1:{D.NODEAGENT_PORT}",
             help="gRPC host:port (port 0: any free); loopback by default, give the pod IP to let lockd in")
    env_flag(p, "--advertise", default="", help="host:port written in the agent key (default: derived)")
    env_flag(p, "--metrics-port", type=int, default=D.NODEAGENT_METRICS_PORT, help="Prometheus port; -1 = off")
    env_flag(p, "--metrics-host", default="0.0.0.0", help="address of the metrics endpoint (pod IP, 127.0.0.1)")
    env_flag(p, "--backend", default="auto", help="auto | cuda-driver | cuda-checkpoint | sim")
    env_flag(p, "--state-dir", ENV_STATE_DIR, default=DEFAULT_STATE_DIR,
          help="local state (fencing tokens, snapshot size records)")
    env_flag(p, "--host-reserve-bytes", type=int, default=DEFAULT_HOST_RESERVE_BYTES,
          help="host memory kept free: a snapshot that would dip into it is refused")
    env_flag(p, "--lock-timeout-ms", type=int, default=DEFAULT_LOCK_TIMEOUT_MS,
          help="checkpoint lock wait for in-flight GPU work, ms")
    env_flag(p, "--refresh-interval", type=float, default=2.0, help="agent key refresh period, s")
    env_flag(p, "--agent-lease-ttl", type=int, default=10,
          help="TTL of the lease that keeps this agent's liveness key, s")
    env_flag(p, "--sim-dir", default=None, help="simulated device directory (backend sim)")
    env_flag(p, "--sim-capacity-bytes", type=int, default=None, help="simulated device capacity")
    env_flag(p, "--sim-checkpoint-gbps", type=float, default=None, help="simulated checkpoint bandwidth, GB/s")
    env_flag(p, "--sim-restore-gbps", type=float, default=None, help="simulated restore bandwidth, GB/s")
    env_flag(p, "--admin-token-file", default=None,
             help="file holding the bearer token the direct Snapshot/Restore/GetOperation calls need "
                  "(else $TIMESLICE_ADMIN_TOKEN; with neither, they are refused)")
    env_flag(p, "--insecure-no-admin-auth", type=_bool, default=False, nargs="?", const=True,
             help="let any caller use the direct API (test setups only; never in production)")
    env_flag(p, "--tls-cert", default=None, help="server certificate of the direct API (turns on TLS)")
    env_flag(p, "--tls-key", default=None, help="server key")
    env_flag(p, "--tls-client-ca", default=None, help="CA of the client certificates to require (mutual TLS)")
    env_flag(p, "--log-level", default="info")
    env_flag(p, "--channel-socket", "TIMESLICE_AGENT_SOCKET", default="",
          help="Unix socket for cooperative workers (default: /run/timeslice/agent-<node>.sock as root, "
               "else a per-user temp dir)")
    env_flag(p, "--swap-deadline-s", type=float, default=120.0,
          help="how long a cooperative worker or inference server may take to pause/resume, s")
    env_flag(p, "--reconnect-grace-s", type=float, default=DEFAULT_RECONNECT_GRACE_S,
          help="how long an op waits for a cooperative worker without a channel to this agent (after an agent "
               "restart, or closing) to reconnect or exit before it fails the waiting job with the reason, s")
    env_flag(p, "--app-drain-s", type=float, default=0.0,
          help="how long an inference server's in-flight requests may take to finish before it is put to "
               "sleep, s (0: half of --swap-deadline-s)")
    env_flag(p, "--app-drain-expired", choices=("refuse", "abort"), default="refuse",
          help="requests still in flight at the drain deadline: refuse the swap (the server serves on) "
               "or abort them and sleep (default: %(default)s)")
    env_flag(p, "--require-attestation", action="store_true", default=False,
          help="act only on registered pids that the job's own processes attested over the node-local "
               "channel (the client library does it when it registers a worker)")
    env_flag(p, "--parked-warn-s", type=float, default=300.0,
          help="log a warning once a job has been parked (snapshotted) this long, s")
    env_flag(p, "--freeze-parked", action="store_true", default=False,
          help="lock paused cooperative workers: a stray GPU call waits while parked, but (measured on an "
               "H200) faults once unlocked for the resume; off by default")



def _opt(v, cast):
    return None if v is None or v == "" else cast(v)


def from_args(a: argparse.Namespace) -> AgentConfig:
    etcd = etcd_config(a)
    try:
        return AgentConfig(
            node=a.node or socket.gethostname(), etcd=etcd, prefix=a.prefix, listen=a.listen,
            advertise=a.advertise or "", metrics_port=int(a.metrics_port), backend=a.backend,
            metrics_host=a.metrics_host or "0.0.0.0",
            state_dir=a.state_dir, host_reserve_bytes=int(a.host_reserve_bytes),
            lock_timeout_ms=int(a.lock_timeout_ms), refresh_interval=float(a.refresh_interval),
            session=SessionTiming(ttl=int(a.agent_lease_ttl)), sim_dir=a.sim_dir or None,
            sim_capacity_bytes=_opt(a.sim_capacity_bytes, int),
            sim_checkpoint_gbps=_opt(a.sim_checkpoint_gbps, float),
            sim_restore_gbps=_opt(a.sim_restore_gbps, float), admin_token_file=a.admin_token_file or None,
            insecure_no_admin_auth=_bool(a.insecure_no_admin_auth), tls_cert=a.tls_cert or None,
            tls_key=a.tls_key or None, tls_client_ca=a.tls_client_ca or None, log_level=a.log_level,
            channel_socket=a.channel_socket or "", swap_deadline_s=float(a.swap_deadline_s),
            reconnect_grace_s=float(a.reconnect_grace_s),
            app_drain_s=float(a.app_drain_s), app_drain_expired=a.app_drain_expired,
            freeze_parked=bool(a.freeze_parked), parked_warn_s=float(a.parked_warn_s),
            require_attestation=bool(a.require_attestation))
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
