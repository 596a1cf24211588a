"""Loopback helpers shared by the local launcher and the test harness: free ports, plain JSON over HTTP.

Product code (the launcher) and the harness both need them; they live here so that
no product module imports the test harness (tests/test_import_boundary.py).

A port is found by binding port 0 and releasing it, so another process may take it
before our server binds it; callers that can detect "address already in use" retry
with fresh ports. Within this process the same port is never handed out twice in a
row, which removes the common collision (two servers getting the same freed port).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request

_recent: list[int] = []  # ports handed out lately, oldest first
_RECENT_MAX = 256
_lock = threading.Lock()
# No proxy: an http_proxy in the environment must not capture loopback probes.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago and not handed out lately."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        with _lock:
            if port in _recent:
                continue
            _recent.append(port)
            del _recent[:-_RECENT_MAX]
            return port
    raise RuntimeError(f"no free port found on {host}")


def http_json(port: int, path: str, body: bytes | None, timeout: float) -> dict | None:
    """GET (``body`` None) or POST a loopback port; the decoded JSON, or None on any failure."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    try:
        with _opener.open(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None
