"""The channel's door: accept every connection at once and hold it, cheaply, until its hello has arrived.

A local process that floods the agent's socket with silent connections must not
make a real worker's ``connect()`` fail (a full listen backlog answers EAGAIN), nor
starve the agent's event loop (its etcd keepalive, the swaps in flight). So the
door works below asyncio's streams:

* the listening socket is drained on every wake-up, a bounded batch at a time
  (the loop runs its other callbacks between batches);
* a connection costs a socket and a seat in the ``Lobby`` until a whole hello
  frame has arrived: no task, no transport, no buffer beyond one frame; when a
  bound is reached the lobby's victim is closed (after a refusal frame), never
  the newcomer;
* a connection that has sent no whole hello within ``hello_timeout`` is refused
  and closed by a sweep once a second;
* evictions are logged as counts, once a second, not once each (a flood would
  turn the agent's log into its bottleneck).

Only then is the connection handed on (``on_hello(seat, sock, body)``): the
channel server checks the hello, authorizes the job and serves the worker.
"""
from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from timeslice.common import channel as C
from timeslice.common import frames as F
from timeslice.nodeagent.lobby import Lobby, Seat

log = structlog.get_logger(__name__)

BACKLOG = 1024                # the kernel caps it at net.core.somaxconn
ACCEPT_BATCH = 128            # accepts per wake-up before the loop runs anything else
_PEERCRED = struct.Struct("3i")
_LEN = 4


@dataclass(eq=False)
class Pending:
    """A connection in the lobby: its socket and what it has sent of its hello."""

    sock: socket.socket
    since: float
    buf: bytearray = field(default_factory=bytearray)
    reading: bool = True              # registered with the loop for its hello bytes
    closed: bool = False
    on_evict: Callable[[], None] | None = None  # set once handed on: how the server closes it


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the peer, from the kernel (``SO_PEERCRED``)."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


class Listener:
    def __init__(self, path: str | os.PathLike, lobby: Lobby, on_hello: Callable[[Seat, socket.socket, bytes], None],
                 hello_timeout: float):
        self.path, self.lobby, self.on_hello, self.hello_timeout = Path(path), lobby, on_hello, hello_timeout
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task | None = None
        self._evicted: Counter[int] = Counter()        # uid -> evictions since the last log line
        self._accept_errors = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()               # a previous agent's socket: nobody listens on it any more
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind(str(self.path))
        # Any local process may connect: who it is comes from SO_PEERCRED and the session secret.
        os.chmod(self.path, 0o666)
        s.listen(BACKLOG)
        self._sock = s
        self._loop.add_reader(s.fileno(), self._accept)
        self._sweeper = asyncio.create_task(self._sweep(), name="channel-lobby-sweep")

    async def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for seat in self.lobby.seats():
            self.lobby.leave(seat)
            self.drop(seat)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # -- accepting -------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:             # out of descriptors, most likely: the lobby's bound is too high
                self._accept_errors += 1
                if self._accept_errors == 1:
                    log.error("channel_accept_failed", error=str(e))
                return
            try:
                pid, uid = peer_credentials(conn)
                conn.setblocking(False)
            except OSError:
                conn.close()
                continue
            p = Pending(conn, time.monotonic())
            seat, evicted = self.lobby.enter(pid, uid, p)
            for old in evicted:
                self._evicted[old.uid] += 1
                self.refuse(old, "RESOURCE_EXHAUSTED", old.why)
            self._loop.add_reader(conn.fileno(), self._read, seat)

    def _read(self, seat: Seat) -> None:
        p = seat.handle
        assert isinstance(p, Pending)
        try:
            data = p.sock.recv(C.MAX_FRAME + _LEN - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:                         # it left before its hello
            self.lobby.leave(seat)
            self.drop(seat)
            return
        p.buf += data
        if len(p.buf) < _LEN:
            return
        try:
            n = C.frame_length(bytes(p.buf[:_LEN]))
        except C.ChannelError as e:
            self.lobby.leave(seat)
            self.refuse(seat, "INVALID_ARGUMENT", f"bad hello: {e}")
            return
        if len(p.buf) < _LEN + n:
            return
        if len(p.buf) > _LEN + n:            # a worker waits for its welcome before it says anything more
            self.lobby.leave(seat)
            self.refuse(seat, "INVALID_ARGUMENT", "bad hello: more than one frame before the welcome")
            return
        self._stop_reading(p)
        body = bytes(p.buf[_LEN:])
        p.buf = bytearray()
        self.on_hello(seat, p.sock, body)    # the seat stays taken until the server has decided

    def _stop_reading(self, p: Pending) -> None:
        if p.reading and self._loop is not None:
            self._loop.remove_reader(p.sock.fileno())
            p.reading = False

    # -- closing ---------------------------------------------------------------------
    def refuse(self, seat: Seat, code: str, message: str) -> None:
        """Say why (best effort: never blocks), then close. The seat must have left the lobby."""
        p = seat.handle
        assert isinstance(p, Pending)
        if p.on_evict is None and not p.closed:
            try:
                p.sock.send(C.encode(F.refused(code, message)))
            except OSError:
                pass
        self.drop(seat)

    def drop(self, seat: Seat) -> None:
        p = seat.handle
        assert isinstance(p, Pending)
        if p.on_evict is not None:           # the server holds it now (a stream): it closes it its way
            p.on_evict()
            return
        if p.closed:
            return
        self._stop_reading(p)
        p.closed = True
        p.sock.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for seat in self.lobby.seats():
                p = seat.handle
                assert isinstance(p, Pending)
                if p.on_evict is None and now - p.since > self.hello_timeout:
                    self.lobby.leave(seat)
                    self.refuse(seat, "INVALID_ARGUMENT", f"bad hello: none within {self.hello_timeout:g} s")
            if self._evicted:
                log.warning("channel_evictions", per_uid=dict(self._evicted), waiting=len(self.lobby),
                            why="connections waiting for a hello past the lobby's bounds")
                self._evicted.clear()
            if self._accept_errors > 1:
                log.error("channel_accept_failed", count=self._accept_errors)
            self._accept_errors = 0
