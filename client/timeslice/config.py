"""Where the client's settings come from, validated before anything connects.

* target: the ``target`` argument, else ``$TIMESLICE_TARGET``, else the
  lockd of the local cluster ``timeslice up`` runs on this machine (found
  through its per-user pointer, as the ``timeslice`` CLI finds it:
  ``timeslice.common.local``), else ``timeslice.common.defaults.LOCKD_TARGET``
  (127.0.0.1:50051). The client logs which it used (event ``client_target``,
  ``source``: argument, env, local-cluster, default). One address, a
  comma-separated list, or a list: one per lockd replica. A DNS name that
  resolves to every replica (a Kubernetes headless Service) is one target;
  gRPC's resolver then spreads over its addresses. ``host`` without a port
  gets the default port 50051.
* job id: the ``job_id`` argument, else ``$TIMESLICE_JOB_ID``, else the Slurm
  job's id (``$SLURM_JOB_ID``: inside an ``sbatch``/``srun`` job, so a job needs
  no setting of its own and ``squeue`` and ``timeslice jobs`` show the same id),
  else a fresh unique id ``<host>-<pid>-<random>`` that is logged (event
  ``job_id_generated``).
* node name (worker registration): ``$TIMESLICE_NODE_NAME``, else the host
  name made to fit the id grammar.
* session TTL: 3..300 s (lockd's limits); keepalives go every TTL/3.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from timeslice.common import defaults as D
from timeslice.common import local
from timeslice.common.errors import InvalidIdError
from timeslice.common.ids import MAX_ID_LEN, check_id
from timeslice.errors import InvalidArgumentError
from timeslice.retry import RetryPolicy

MIN_TTL, MAX_TTL = 3, 300
DEFAULT_TTL = 10
DEFAULT_TIMEOUT = 15.0      # s; overall deadline of every non-blocking call, failover included


TARGET_SOURCES = ("argument", "env", "local-cluster", "default")


def find_target(target: str | Sequence[str] | None) -> tuple[str | Sequence[str], str, str]:
    """(target, where it came from, the local cluster's state file or ""), in the module doc's order."""
    if target is not None and not (isinstance(target, str) and not target.strip()):
        return target, "argument", ""
    env = os.environ.get(D.ENV_TARGET, "").strip()
    if env:
        return env, "env", ""
    found = local.running_cluster()
    if found is not None and isinstance(found[1].get("target"), str) and found[1]["target"]:
        return found[1]["target"], "local-cluster", str(found[0])
    return D.LOCKD_TARGET, "default", ""


def parse_targets(target: str | Sequence[str] | None) -> list[str]:
    """The lockd addresses to use, in preference order (see the module doc)."""
    target = find_target(target)[0]
    parts = target.split(",") if isinstance(target, str) else list(target)
    out: list[str] = []
    for p in parts:
        p = p.strip()
        if not p:
            continue
        p = _with_port(p)
        if p not in out:
            out.append(p)
    if not out:
        raise InvalidArgumentError(f"no lockd target in {target!r}")
    return out


def _with_port(t: str) -> str:
    if "://" in t or t.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return t
    if t.startswith("["):                                  # [v6] or [v6]:port
        return t if "]:" in t else f"{t}:{D.LOCKD_PORT}"
    if t.count(":") == 1:
        port = t.split(":")[1]
        if not port.isdigit():
            raise InvalidArgumentError(f"lockd target {t!r}: port {port!r} is not a number")
        return t
    if ":" in t:                                           # a bare IPv6 address
        return f"[{t}]:{D.LOCKD_PORT}"
    return f"{t}:{D.LOCKD_PORT}"


def sanitize_id(text: str, fallback: str = "node") -> str:
    """``text`` made to fit the id grammar: bad characters become '-', trimmed to 127."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text or "")
    s = re.sub(r"^[^A-Za-z0-9]+", "", s)[:MAX_ID_LEN].rstrip("-.")
    return s or fallback


def node_name() -> str:
    env = os.environ.get(D.ENV_NODE_NAME, "").strip()
    return valid_id("node", env) if env else sanitize_id(socket.gethostname())


def generated_job_id() -> str:
    host = sanitize_id(socket.gethostname(), "job")[:48]
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def valid_id(kind: str, value: object) -> str:
    try:
        return check_id(kind, value)
    except InvalidIdError as e:
        raise InvalidArgumentError(str(e), code="INVALID_ARGUMENT") from None


def resolve_job_id(job_id: str | None) -> tuple[str, bool]:
    """(job id, whether it was generated)."""
    if job_id:
        return valid_id("job", job_id), False
    for var in (D.ENV_JOB_ID, D.ENV_SLURM_JOB_ID):
        env = os.environ.get(var, "").strip()
        if env:
            return valid_id("job", env), False
    return generated_job_id(), True


@dataclass(frozen=True)
class ClientConfig:
    targets: tuple[str, ...]
    job_id: str
    job_id_generated: bool
    session_ttl: int = DEFAULT_TTL
    timeout: float = DEFAULT_TIMEOUT
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    target_source: str = "argument"       # one of TARGET_SOURCES
    target_origin: str = ""               # local-cluster: the cluster's state file

    def __post_init__(self) -> None:
        if not isinstance(self.session_ttl, int) or not MIN_TTL <= self.session_ttl <= MAX_TTL:
            raise InvalidArgumentError(
                f"session_ttl must be an int in [{MIN_TTL}, {MAX_TTL}] seconds, got {self.session_ttl!r}")
        if not self.timeout or self.timeout <= 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {self.timeout!r}")

    @classmethod
    def build(cls, target, job_id, session_ttl: int, timeout: float,
              retry: RetryPolicy | None = None) -> ClientConfig:
        jid, generated = resolve_job_id(job_id)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        found, source, origin = find_target(target)
        return cls(tuple(parse_targets(found)), jid, generated, session_ttl, float(timeout),
                   retry or RetryPolicy(attempt_timeout=min(RetryPolicy.attempt_timeout, float(timeout))),
                   target_source=source, target_origin=origin)

    @property
    def keepalive_period(self) -> float:
        """Seconds between keepalives: a third of the TTL, so two may fail before it lapses."""
        return self.session_ttl / 3

    @property
    def keepalive_attempt_timeout(self) -> float:
        """One keepalive attempt's deadline: short, so a paused replica is left in time."""
        return max(1.0, self.session_ttl / 4)


#: How fast a client notices a replica that stopped answering (SIGSTOP, a GC or VM
#: freeze, a frozen cgroup): HTTP/2 keepalive pings every KEEPALIVE_TIME_MS while a
#: call is open, and a ping not answered within KEEPALIVE_TIMEOUT_MS closes the
#: connection, so a blocked Acquire fails with UNAVAILABLE and is re-sent to the
#: next replica, as after a kill. A stopped process keeps its TCP connections open:
#: without pings its clients wait for it for as long as it is stopped.
KEEPALIVE_TIME_MS = 1000
KEEPALIVE_TIMEOUT_MS = 1000

#: gRPC channel options shared by both clients. lockd (lockd/server.py) accepts a
#: ping every 500 ms without strikes, so these pings never earn a GOAWAY.
CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 0),            # retries are ours (retry.py), not the channel's
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # gRPC >= 1.6x times an unanswered ping out by this one (default 60 s), not the above.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),   # only while a call is open (an idle channel costs nothing)
    ("grpc.http2.max_pings_without_data", 0),     # a blocked Acquire sends no data for minutes
]
