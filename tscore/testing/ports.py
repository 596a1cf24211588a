"""Free loopback ports for test servers.

A port is found by binding port 0 and releasing it, so another process may take
it before our server binds it; callers that can detect "address already in use"
retry with fresh ports. Within this process we never hand out the same port
twice in a row, which removes the common collision (two servers of one test
getting the same recently freed port).
"""
from __future__ import annotations

import socket
import threading

_recent: list[int] = []  # ports handed out lately, oldest first
_RECENT_MAX = 256
_lock = threading.Lock()


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
