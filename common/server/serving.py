"""Pieces every server of the project shares: error-to-status mapping, health, flags.

- ``rpc``: decorator for thin servicer methods; a ``TimesliceError`` becomes the
  gRPC status its ``code`` names, with its message, in one place (``stream_rpc``:
  the same for a server-streaming method).
- ``health_loop``: SERVING only while a probe (can we reach etcd?) passes, so
  load balancers and Kubernetes send traffic only to processes that can answer.
- ``env_flag``: an argparse flag whose default comes from ``TIMESLICE_<FLAG>``;
  ``add_etcd_flags`` / ``etcd_config`` are the etcd connection flags every server takes.
- ``serve_config`` parses a server's ``<prog> serve ...`` command line; ``ready_until_signalled``
  prints its ready line and waits for SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2

from timeslice.common import defaults as D
from timeslice.common.errors import TimesliceError
from timeslice.common.server import logs
from timeslice.common.server.etcd.client import EtcdConfig
from timeslice.common.version import __version__

_log = structlog.get_logger(__name__)


#: Longest status message a server sends. gRPC refuses reply metadata over ~16 KB
#: (the caller then sees RESOURCE_EXHAUSTED instead of the real status), and a
#: message echoing a caller's input must not grow with that input.
MAX_MESSAGE = 1024


def status_of(e: TimesliceError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit - 40] + f"... [{len(text) - limit + 40} more characters]"


def rpc(fn):
    """Thin-servicer decorator: a TimesliceError becomes its status with a bounded message; any
    other exception is logged and becomes INTERNAL (never UNKNOWN naming a Python class)."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(fn, context, e)
    return wrapper


def stream_rpc(fn):
    """``rpc`` for a server-streaming method (an async generator): the same mapping of errors, so a
    stream never ends with UNKNOWN naming a Python class."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(fn, context, e)
    return wrapper


async def _abort(fn, context, e: Exception) -> None:
    """End the call with the status ``e`` means: a ``TimesliceError``'s own, else INTERNAL (a bug
    must still give the caller a status by meaning), logged with an incident id the caller sees."""
    if isinstance(e, TimesliceError):
        await context.abort(status_of(e), bounded(str(e)))    # raises: the call ends here
        return
    incident = uuid.uuid4().hex[:12]
    _log.exception("rpc_internal_error", method=fn.__name__, incident=incident)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error in {fn.__name__} (incident {incident} in the server's log)")


async def health_loop(hs: health.aio.HealthServicer, service: str, probe: Callable[[], Awaitable[bool]],
                      on_result: Callable[[bool], None] | None = None, period: float = 2.0) -> None:
    while True:
        ok = await probe()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", service):
            await hs.set(name, status)
        if on_result is not None:
            on_result(ok)
        await asyncio.sleep(period)


async def ready_until_signalled(tag: str, port: int, ready: Callable[[int], None] | None, **fields) -> None:
    """Print the machine-readable ready line (``<TAG>``, with ``port``: what launchers and tests that
    bind port 0 wait for), call ``ready(port)``, then return at SIGTERM or SIGINT."""
    logs.ready(tag, port=port, **fields)
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def serve_config(prog: str, description: str, serve_help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                 from_args: Callable[[argparse.Namespace], Any], argv: list[str] | None,
                 invalid: tuple[type[Exception], ...]) -> Any:
    """The config of ``<prog> serve ...`` parsed from ``argv``; None once an ``invalid`` error is said."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--version", action="version", version=f"{prog} {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_arguments(sub.add_parser("serve", help=serve_help))
    a = p.parse_args(argv)
    try:
        return from_args(a)
    except invalid as e:
        print(f"{prog}: invalid configuration: {e}", file=sys.stderr)
        return None


def env_name(flag: str) -> str:
    return "TIMESLICE_" + flag.lstrip("-").replace("-", "_").upper()


def env_flag(p: argparse.ArgumentParser, name: str, *fallback_env: str, **kw) -> None:
    """Add ``name``; its default is taken from TIMESLICE_<NAME> (or ``fallback_env``) when set."""
    envs = (env_name(name), *fallback_env)
    for env in envs:
        if env in os.environ:
            kw["default"] = os.environ[env]
            break
    kw["help"] = (kw.get("help", "") + f" [env {' or '.join(envs)}]").strip()
    p.add_argument(name, **kw)


def parse_bool(v) -> bool:
    """A boolean flag or environment value: 1/true/yes/on or 0/false/no/off."""
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {str(v)[:20]!r}")


def add_etcd_flags(p: argparse.ArgumentParser) -> None:
    """--etcd-endpoints/-ca/-cert/-key/-timeout and --prefix (user and password come from
    TIMESLICE_ETCD_USER / TIMESLICE_ETCD_PASSWORD only: never on a command line)."""
    env_flag(p, "--etcd-endpoints", default=D.ETCD_ENDPOINTS, help="comma-separated etcd host:port")
    env_flag(p, "--etcd-ca", default=None, help="CA bundle for etcd TLS")
    env_flag(p, "--etcd-cert", default=None, help="client certificate for etcd")
    env_flag(p, "--etcd-key", default=None, help="client key for etcd")
    env_flag(p, "--etcd-timeout", type=float, default=5.0, help="deadline of each etcd call, s")
    env_flag(p, "--prefix", default=D.KEY_PREFIX, help="key prefix in etcd")


def etcd_config(a: argparse.Namespace) -> EtcdConfig:
    return EtcdConfig.parse(
        a.etcd_endpoints, timeout=float(a.etcd_timeout), ca_file=a.etcd_ca, cert_file=a.etcd_cert,
        key_file=a.etcd_key, username=os.environ.get(D.ENV_ETCD_USER), password=etcd_password())


def etcd_password() -> str | None:
    """TIMESLICE_ETCD_PASSWORD, or the contents of TIMESLICE_ETCD_PASSWORD_FILE (a node's own
    secret file on Kubernetes: deploy/components/etcd-auth)."""
    path = os.environ.get(D.ENV_ETCD_PASSWORD_FILE)
    if path and D.ENV_ETCD_PASSWORD not in os.environ:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get(D.ENV_ETCD_PASSWORD)
