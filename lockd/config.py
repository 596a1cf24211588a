"""lockd's configuration: flags, environment, defaults, validated at start-up.

Every flag can also be set as TIMESLICE_<FLAG> in the environment (dashes
become underscores, e.g. --etcd-endpoints = TIMESLICE_ETCD_ENDPOINTS); a flag
on the command line wins. Invalid or inconsistent timing fails start-up.
"""
from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

from timeslice.common import defaults as D
from timeslice.common.errors import ConfigError
from timeslice.common.ids import check_id
from timeslice.common.server.auth import load_admin_token
from timeslice.common.server.etcd.client import EtcdConfig
from timeslice.common.server.etcd.timing import ElectionTiming
from timeslice.common.server.keys import Keys
from timeslice.common.server.serving import add_etcd_flags, env_flag, etcd_config
from timeslice.common.server.serving import parse_bool as _bool
from timeslice.lockd import callers
from timeslice.lockd import footprints as FP
from timeslice.lockd.callers import CallerConfig
from timeslice.lockd.plan import Policy
from timeslice.lockd.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_PEER, SessionLimits
from timeslice.lockd.workers import MAX_WORKERS_PER_JOB


@dataclass(frozen=True)
class LockdConfig:
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    prefix: str = D.KEY_PREFIX
    listen: str = f"0.0.0.0:{D.LOCKD_PORT}"
    replica_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    metrics_port: int = D.LOCKD_METRICS_PORT      # -1: no metrics endpoint
    metrics_host: str = "0.0.0.0"                 # address the metrics endpoint binds (pod IP / 127.0.0.1)
    election: ElectionTiming = field(default_factory=ElectionTiming)
    sessions: SessionLimits = field(default_factory=SessionLimits)
    policy: Policy = field(default_factory=Policy)
    tls_cert: str | None = None
    tls_key: str | None = None
    admin_token_file: str | None = None        # None: $TIMESLICE_ADMIN_TOKEN, else admin calls are refused
    insecure_no_admin_auth: bool = False       # admin calls open to anyone: throw-away test setups only
    max_groups: int = 4096                     # groups in the system (CreateGroup beyond: RESOURCE_EXHAUSTED)
    max_workers_per_job: int = MAX_WORKERS_PER_JOB   # registered processes of one job (RegisterWorker beyond: ditto)
    callers: CallerConfig = field(default_factory=CallerConfig)   # read auth, tenants, watch limits
    log_level: str = "info"
    profile_phases: int = 64                   # samples per distribution of a job's profile (lockd/profiles.py)

    def __post_init__(self) -> None:
        Keys(self.prefix)                           # raises on a malformed prefix
        check_id("replica", self.replica_id)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--listen {self.listen!r} is not host:port")
        load_admin_token(self.admin_token_file)     # a bad token file fails start-up, not the first call
        if self.max_groups < 1:
            raise ConfigError("--max-groups must be >= 1")
        if self.max_workers_per_job < 1:
            raise ConfigError("--max-workers-per-job must be >= 1")
        if self.policy.swap_timeout_ms <= 0:
            raise ConfigError("--swap-timeout must be > 0")
        if not 1 <= self.profile_phases <= 1024:
            raise ConfigError("--profile-phases must be in [1, 1024]")
        if self.callers.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if self.insecure_no_admin_auth and self.callers.tenants_file is not None:
            raise ConfigError("--insecure-no-admin-auth and --tenants-file do not go together: tenants need a "
                              "real admin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_etcd_flags(p)
    env_flag(p, "--listen", default=f"0.0.0.0:{D.LOCKD_PORT}", help="gRPC host:port (port 0: any free)")
    env_flag(p, "--replica-id", default=None, help="this replica's name (default host-pid)")
    env_flag(p, "--metrics-port", type=int, default=D.LOCKD_METRICS_PORT, help="Prometheus port; -1 = off")
    env_flag(p, "--metrics-host", default="0.0.0.0", help="address of the metrics endpoint (pod IP, 127.0.0.1)")
    # Defaults sized for a failover within ~3 s: a dead leader's lease expires after
    # --lease-ttl, and plain handoffs go on meanwhile (fenced by its still-valid epoch).
    # 3 s is etcd's minimum lease TTL with its default 1 s election timeout.
    env_flag(p, "--lease-ttl", type=int, default=3, help="leader lease TTL, s")
    env_flag(p, "--renew-deadline", type=float, default=2.0, help="leader steps down after failing to renew, s")
    env_flag(p, "--retry-period", type=float, default=0.5, help="leader keepalive / campaign period, s")
    env_flag(p, "--session-ttl", type=int, default=10, help="default job session TTL, s")
    env_flag(p, "--swap-timeout", type=float, default=120.0, help="an agent op not reported by then fails, s")
    env_flag(p, "--device-margin-bytes", type=int, default=0, help="device memory kept free beside a job")
    # What a grant admits (lockd/footprints.py; README, "Memory a grant admits"): defaults from the H200.
    env_flag(p, "--footprint-margin", type=float, default=FP.DEFAULT_POLICY.margin_fraction,
             help="share added to a job's footprint for the allocator's slack and the phase-to-phase spread")
    env_flag(p, "--first-hold-spare", type=float, default=FP.DEFAULT_POLICY.first_hold_spare,
             help="share more asked of a first hold (a declared peak, none observed yet)")
    env_flag(p, "--unmeasured-context", type=float, default=FP.DEFAULT_POLICY.context_fraction,
             help="share of a GPU counted for a job's context until it is measured (the H200's: 612 MiB)")
    env_flag(p, "--tls-cert", default=None, help="server certificate (turns on TLS)")
    env_flag(p, "--tls-key", default=None, help="server key")
    env_flag(p, "--admin-token-file", default=None,
             help="file holding the admin bearer token that CreateGroup/DeleteGroup need "
                  "(else $TIMESLICE_ADMIN_TOKEN; with neither, admin calls are refused)")
    env_flag(p, "--insecure-no-admin-auth", type=_bool, default=False, nargs="?", const=True,
             help="let anyone make admin calls (test setups only; never in production)")
    env_flag(p, "--max-groups", type=int, default=4096, help="most groups the system holds")
    env_flag(p, "--max-workers-per-job", type=int, default=MAX_WORKERS_PER_JOB,
             help="most worker processes one job may register (all nodes together); RegisterWorker beyond: "
                  "RESOURCE_EXHAUSTED 'limit max_workers_per_job'")
    env_flag(p, "--max-sessions", type=int, default=MAX_SESSIONS,
             help="most live job sessions in the system (each is an etcd lease); OpenSession beyond: "
                  "RESOURCE_EXHAUSTED 'limit max_sessions'")
    env_flag(p, "--max-sessions-per-peer", type=int, default=MAX_SESSIONS_PER_PEER,
             help="most live sessions one caller may hold: a caller is its mutual-TLS certificate's CN when "
                  "it presents one, else its IP address (port ignored; behind a proxy all clients share the "
                  "proxy's); beyond: RESOURCE_EXHAUSTED 'limit max_sessions_per_peer'")
    callers.add_arguments(p)
    env_flag(p, "--log-level", default="info")
    env_flag(p, "--profile-phases", type=int, default=64,
             help="newest phases per job and group that a profile shows (hold, gap, wait, swap samples)")


def _footprint(a: argparse.Namespace) -> FP.FootprintPolicy:
    try:
        return FP.FootprintPolicy(context_fraction=float(a.unmeasured_context),
                                  margin_fraction=float(a.footprint_margin), first_hold_spare=float(a.first_hold_spare))
    except ValueError as e:
        raise ConfigError(f"--unmeasured-context, --footprint-margin, --first-hold-spare: {e}") from None


def from_args(a: argparse.Namespace) -> LockdConfig:
    etcd = etcd_config(a)
    kw = {}
    if a.replica_id:
        kw["replica_id"] = a.replica_id
    return LockdConfig(
        etcd=etcd, prefix=a.prefix, listen=a.listen, metrics_port=int(a.metrics_port),
        metrics_host=a.metrics_host or "0.0.0.0",
        election=ElectionTiming(int(a.lease_ttl), float(a.renew_deadline), float(a.retry_period)),
        sessions=SessionLimits(default_ttl=int(a.session_ttl), min_ttl=min(3, int(a.session_ttl)),
                               max_sessions=int(a.max_sessions), max_per_peer=int(a.max_sessions_per_peer)),
        policy=Policy(swap_timeout_ms=int(float(a.swap_timeout) * 1000),
                      device_margin_bytes=int(a.device_margin_bytes), footprint=_footprint(a)),
        tls_cert=a.tls_cert, tls_key=a.tls_key, admin_token_file=a.admin_token_file or None,
        insecure_no_admin_auth=_bool(a.insecure_no_admin_auth), max_groups=int(a.max_groups),
        max_workers_per_job=int(a.max_workers_per_job), callers=callers.from_args(a),
        log_level=a.log_level, profile_phases=int(a.profile_phases), **kw)
