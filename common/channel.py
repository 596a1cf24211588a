"""The node-local channel between a cooperative worker and its node agent: where, and how framed.

A cooperative worker (``timeslice.cooperative``) opens a Unix stream socket to
the agent of its node when it registers; the agent later asks it, over that
connection, to pause (release its device memory) or resume. The agent learns
the worker's pid from the kernel (``SO_PEERCRED``), never from the worker, and
the job from the session secret the worker presents, so no job can make the
agent act on another job's process.

Frames are a 4-byte big-endian length followed by that many bytes of UTF-8
JSON (one object). Frames are bounded by ``MAX_FRAME``: a peer that sends a
longer one is cut off. The messages themselves (one builder each, and the
checks the agent runs on them) are in ``timeslice.common.frames``.

This module has no server-side dependency: the job imports it.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

import tenacity

ENV_SOCKET = "TIMESLICE_AGENT_SOCKET"
PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 10          # a hello with 32 tags is ~2 KiB; nothing legitimate comes near this
MAX_DEPTH = 8                 # objects and lists nested in a frame; the protocol's frames nest 2 deep
CONNECT_TIMEOUT_S = 30.0      # how long a connect waits out a full backlog (another process flooding the socket)
_LEN = struct.Struct(">I")


class ChannelError(Exception):
    """The channel broke or a peer spoke out of protocol."""


def default_socket_path(node: str) -> Path:
    """Where the agent of ``node`` listens unless told otherwise (``$TIMESLICE_AGENT_SOCKET``).

    ``/run/timeslice/agent-<node>.sock`` when running as root (the DaemonSet
    mounts /run/timeslice from the host into the job's pods), otherwise a
    per-user directory under the temp dir. When nothing listens there, a local
    cluster started by ``timeslice up`` for ``node`` is looked for (its socket is
    in its run folder: ``timeslice.common.local``).
    """
    env = os.environ.get(ENV_SOCKET)
    if env:
        return Path(env)
    std = _standard_path(node)
    if not std.exists():
        from timeslice.common.local import agent_socket
        local = agent_socket(node)
        if local is not None:
            return local
    return std


def _standard_path(node: str) -> Path:
    if os.geteuid() == 0:
        return Path("/run/timeslice") / f"agent-{node}.sock"
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                           f"timeslice-{os.geteuid()}")
    return Path(base) / f"agent-{node}.sock"


def reachable(node: str) -> bool:
    """True if an agent socket for ``node`` is named ($TIMESLICE_AGENT_SOCKET) or exists on this machine."""
    return bool(os.environ.get(ENV_SOCKET)) or default_socket_path(node).exists()


class BacklogFull(ConnectionError):
    """The agent's socket kept answering EAGAIN (its listen backlog full) until the connect's time ran out."""


def _backlog_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def connect(path: str, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A stream socket connected to ``path`` within ``timeout`` seconds (the worker side).

    A Unix socket whose listen backlog is full answers ``connect()`` with EAGAIN at
    once, where TCP would wait. While other local processes flood the agent's socket
    that is transient: it is tried again with jittered exponential backoff (tenacity;
    a connect that failed changed nothing, so it is safe to repeat) until ``timeout``,
    and then ``BacklogFull`` says so, with how long and how many attempts. Any other
    error (nobody listens, no such socket) is raised at once.
    """
    deadline = time.monotonic() + timeout

    def once() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return s

    retrying = tenacity.Retrying(retry=tenacity.retry_if_exception(_backlog_full),
                                 wait=tenacity.wait_random_exponential(multiplier=0.01, max=0.5),
                                 stop=tenacity.stop_after_delay(timeout), reraise=True)
    try:
        return retrying(once)
    except OSError as e:
        if not _backlog_full(e):
            raise
        tries = retrying.statistics.get("attempt_number", 1)
        raise BacklogFull(e.errno, f"the node agent's channel at {path} stayed full (its listen backlog: a flood of "
                                   f"connections?) for {timeout:g} s; gave up after {tries} attempts") from e


def encode(msg: Mapping[str, object]) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), sort_keys=True).encode()
    if len(body) > MAX_FRAME:
        raise ChannelError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a 4-byte header announces; ChannelError past ``MAX_FRAME``."""
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ChannelError(f"peer announced a {n}-byte frame (limit {MAX_FRAME})")
    return n


def decode(body: bytes) -> dict:
    """One frame's body as an object with a string ``type``; ChannelError for anything else."""
    try:
        msg = json.loads(body)
    except RecursionError:
        # json's decoder recurses per nesting level: 64 KiB of "[" is far past Python's stack.
        raise ChannelError(f"frame nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise ChannelError(f"frame is not JSON: {str(e)[:200]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ChannelError("frame is not an object with a string 'type'")
    if _too_deep(msg):
        raise ChannelError(f"frame nests deeper than {MAX_DEPTH} levels")
    return msg


def _too_deep(msg: dict) -> bool:
    """True if containers nest past ``MAX_DEPTH`` (walked without recursion)."""
    todo: list[tuple[object, int]] = [(msg, 1)]
    while todo:
        obj, depth = todo.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(obj, dict):
            todo.extend((v, depth + 1) for v in obj.values() if isinstance(v, (dict, list)))
        elif isinstance(obj, list):
            todo.extend((v, depth + 1) for v in obj if isinstance(v, (dict, list)))
    return False


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelError("the agent closed the channel")
        buf += chunk
    return bytes(buf)


def send(sock: socket.socket, msg: Mapping[str, object]) -> None:
    """Blocking send of one frame (the worker side)."""
    sock.sendall(encode(msg))


def recv(sock: socket.socket) -> dict:
    """Blocking receive of one frame (the worker side)."""
    return decode(_recv_exact(sock, frame_length(_recv_exact(sock, _LEN.size))))
