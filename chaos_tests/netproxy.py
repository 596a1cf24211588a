"""A TCP relay that can be cut, for partitioning one process from etcd without root.

``Relay(upstream)`` listens on a free loopback port and forwards every
connection to ``upstream``. ``cut()`` models a network partition as a lossy
network does to TCP: nothing crosses any more, in either direction, and
nobody is told (no RST, no FIN); connections opened meanwhile are accepted
but get nothing through. ``heal()`` lets the held bytes through, late, as TCP
retransmission would: a request sent before the cut may reach etcd after it,
which is exactly what leader fencing must withstand.

Pumps hold at most one chunk each while cut; the rest waits in the kernel's
socket buffers. Everything runs in daemon threads of the test process.
"""
from __future__ import annotations

import socket
import threading

from timeslice.testing.ports import free_port


class Relay:
    def __init__(self, upstream: str, listen_host: str = "127.0.0.1"):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.host = listen_host
        self.port = free_port(listen_host)
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self._mu = threading.Lock()
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((self.host, self.port))
        self._lsock.listen(64)
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.port}").start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with self._mu:
            socks, self._socks = self._socks, []
        for s in [self._lsock, *socks]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(down,), daemon=True).start()

    def _connect(self, down: socket.socket) -> None:
        self._open.wait()             # a connection made during a cut gets through only after it
        try:
            up = socket.create_connection(self.upstream, timeout=5)
            up.settimeout(None)
        except OSError:
            down.close()
            return
        with self._mu:
            if self._closed:
                up.close(), down.close()
                return
            self._socks += [down, up]
        for a, b in ((down, up), (up, down)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._open.wait()
                data = src.recv(65536)
                if not data:
                    break
                self._open.wait()     # cut while we held this chunk: it waits, like a lost segment
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
