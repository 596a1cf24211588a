"""Free loopback ports for test servers.

A port is found by binding port 0 and releasing it, so another process may take
it before our server binds it; callers that can detect "address already in use"
retry with fresh ports. Within this process we never hand out the same port
twice in a row, which removes the common collision (two servers of one test
getting the same recently freed port).
"""
from __future__ import annotations

from timeslice.common.server.netutil import free_port

__all__ = ["free_port"]
