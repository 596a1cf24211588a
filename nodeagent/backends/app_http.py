"""The HTTP side of the app-endpoint swappers: one call to an inference server, with a deadline.

Standard library only (``http.client``). Transient failures — connection
refused or reset while the server restarts, HTTP 502/503/504 — are retried with
jittered exponential backoff (tenacity) until the deadline, unless the worker's
process is gone (then at once ``ProcessGone``); anything else fails at once:
a socket timeout (``SwapTimeout``: the deadline is spent), another status
(``SwapRefused``, quoting a bounded prefix of the answer).
"""
from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import tenacity

from timeslice.common import procfs
from timeslice.common.device_errors import ProcessGone
from timeslice.nodeagent.backends.base import DeviceMeter
from timeslice.nodeagent.backends.swapper import SwapConfigError, SwapRefused, SwapTimeout

TRANSIENT_STATUS = frozenset({502, 503, 504})
MAX_REPLY = 64 << 10          # the memory endpoints answer tiny JSON; bound what is read


class _Transient(Exception):
    """A failure worth retrying (the server is restarting or overloaded)."""


def parse_endpoint(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, base path) of an http(s) base URL without credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SwapConfigError(f"endpoint must be an http(s) base URL, got {url[:80]!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise SwapConfigError(f"endpoint must carry no credentials, query or fragment: {url[:80]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise SwapConfigError(f"endpoint port invalid: {url[:80]!r}") from exc
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


class _BackendMeter:
    """A checkpoint ``Backend`` seen as a ``DeviceMeter`` (its device_usage / device_free)."""

    def __init__(self, backend):
        self.backend = backend

    def usage(self, pid: int):
        return self.backend.device_usage(pid)

    def free(self):
        return self.backend.device_free()


def as_meter(obj) -> DeviceMeter | None:
    """A DeviceMeter (NVML, SimMeter), or a Backend's sizes; None: no verification."""
    if obj is None or hasattr(obj, "usage"):
        return obj
    if hasattr(obj, "device_usage"):
        return _BackendMeter(obj)
    raise SwapConfigError(f"{type(obj).__name__} is neither a DeviceMeter nor a Backend")


class ServerApi:
    """Calls to one server (``kind`` names it in errors) on behalf of worker ``pid``."""

    def __init__(self, url: str, pid: int, kind: str, proc_root: str = procfs.PROC_ROOT):
        self.scheme, self.host, self.port, self.base = parse_endpoint(url)
        self.pid, self.kind, self.proc_root = pid, kind, proc_root

    def _once(self, method: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, bytes]:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=max(0.05, timeout_s))
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, self.base + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_REPLY)
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected) as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:   # socket.timeout is TimeoutError: not retried, the deadline is spent
            raise SwapTimeout(f"{self.kind} {method} {path}: no answer in {timeout_s:.2f}s", pid=self.pid) from exc
        except OSError as exc:        # unreachable host, DNS: not a restart, fail now
            raise SwapRefused(f"{self.kind} {method} {path}: {exc}", pid=self.pid) from exc
        finally:
            conn.close()
        if resp.status in TRANSIENT_STATUS:
            raise _Transient(f"HTTP {resp.status}")
        return resp.status, raw

    def call(self, method: str, path: str, body: dict | None, deadline: float) -> bytes:
        """One call, retried on transient failures until ``deadline`` (monotonic); the body of a 200."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Transient),
            wait=tenacity.wait_random_exponential(multiplier=0.02, max=0.5),
            stop=lambda rs: time.monotonic() + 0.02 >= deadline,
            reraise=True)

        def attempt() -> tuple[int, bytes]:
            try:
                return self._once(method, path, body, deadline - time.monotonic())
            except _Transient as exc:
                # A restart is worth waiting for; a dead worker is not: fail fast.
                if not procfs.is_alive(self.pid, self.proc_root):
                    raise ProcessGone(f"{self.kind} server of pid {self.pid} is gone ({exc})", pid=self.pid) from exc
                raise

        try:
            status, raw = retrying(attempt)
        except _Transient as exc:
            raise SwapTimeout(f"{self.kind} {method} {path}: still failing at the deadline ({exc})",
                              pid=self.pid) from exc
        if status != 200:
            hint = " (is the memory API enabled on the server?)" if status == 404 else ""
            raise SwapRefused(f"{self.kind} {method} {path}: HTTP {status}{hint}: "
                              f"{raw[:200].decode('utf-8', 'replace')}", pid=self.pid)
        return raw
