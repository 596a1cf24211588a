"""The agent's end of the node-local channel to cooperative workers (``timeslice.channel``).

A worker connects to a Unix socket and says hello with its job and session
secret. Two facts decide whether it is accepted, and neither comes from what
the worker says about itself:

* its **pid** is the kernel's (``SO_PEERCRED``) in the agent's pid namespace
  (the DaemonSet runs with hostPID), so a job cannot claim another's process;
* its **job** is proven by the session secret, checked against the SHA-256
  lockd stored in ``jobs/<job>/session`` (``authorize``).

An accepted connection is kept per pid; the agent's requests (pause, resume)
go out on it with an id and a deadline, answers come back as ``done`` frames.
What a worker last said about itself (paused tags, sizes, host backup) is
remembered after its connection drops, so a parked worker is never forgotten
while it reconnects (e.g. after an agent restart, its hello says what it has
paused); when each channel went is kept too (``lost_at``), for the bounded wait
of ``nodeagent.reconnects``. Everything read from a peer is bounded: frame
size, hello fields, connections in total, requests in flight.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from timeslice import channel as C
from timeslice.common import records as R
from timeslice.common.errors import InvalidIdError
from timeslice.common.ids import check_id
from timeslice.nodeagent.backends import procfs

log = structlog.get_logger(__name__)

HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024
MAX_TAGS = 32
_PEERCRED = struct.Struct("3i")

# authorize(job, secret) -> None if the secret proves the job, else the reason it does not
Authorize = Callable[[str, str], Awaitable[str | None]]


@dataclass
class WorkerInfo:
    """What a cooperative worker told the agent, last time it spoke."""

    pid: int
    uid: int
    job: str
    device: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    region_bytes: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    host_reserving: int = 0            # host bytes a reservation in progress has promised (timeslice.pinned)
    backup: dict[str, int] = field(default_factory=dict)   # the worker's copy counters, as it last said
    paused: list[str] = field(default_factory=list)
    connected: bool = True
    start_time: int | None = None      # the process incarnation that spoke (pids are reused)

    def update(self, msg: dict) -> None:
        if isinstance(msg.get("paused"), list):
            self.paused = [str(t)[:64] for t in msg["paused"] if str(t) in self.tags]
        if isinstance(msg.get("region_bytes"), dict):
            self.region_bytes = {str(t): max(0, int(n)) for t, n in msg["region_bytes"].items()
                                 if str(t) in self.tags and isinstance(n, int)}
        if isinstance(msg.get("host_bytes"), int):
            self.host_bytes = max(0, msg["host_bytes"])
        if isinstance(msg.get("host_reserving"), int):
            self.host_reserving = max(0, msg["host_reserving"])
        if isinstance(msg.get("backup"), dict):
            self.backup = {str(k)[:32]: int(v) for k, v in list(msg["backup"].items())[:16]
                           if isinstance(v, int) and v >= 0}


class WorkerConn:
    def __init__(self, info: WorkerInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.info, self.reader, self.writer = info, reader, writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}

    async def call(self, msg: dict, timeout: float) -> dict:
        """Send a request and wait for its ``done`` (TimeoutError past ``timeout``)."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self.writer.write(C.encode({**msg, "id": rid, "deadline_ms": int(timeout * 1000)}))
            await self.writer.drain()
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(rid, None)

    def deliver(self, msg: dict) -> None:
        fut = self._pending.get(msg.get("id"))  # type: ignore[arg-type]
        if fut is not None and not fut.done():
            fut.set_result(msg)
        self.info.update(msg)

    def fail_all(self, why: str) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))

    def close(self) -> None:
        self.writer.close()


async def _read(reader: asyncio.StreamReader) -> dict:
    n = C.frame_length(await reader.readexactly(4))
    return C.decode(await reader.readexactly(n))


def _hello_fields(msg: dict) -> tuple[str, str, str, dict[str, str]]:
    if msg.get("type") != "hello":
        raise C.ChannelError("the first frame must be a hello")
    job, secret, device = msg.get("job"), msg.get("secret"), msg.get("device", "")
    job = check_id("job", job)
    if not isinstance(secret, str) or not 0 < len(secret) <= 256:
        raise C.ChannelError("hello needs the job's session secret")
    if not isinstance(device, str) or len(device) > 128:
        raise C.ChannelError("device must be a string of at most 128 characters")
    tags = msg.get("tags")
    if not isinstance(tags, dict) or len(tags) > MAX_TAGS:
        raise C.ChannelError(f"hello needs at most {MAX_TAGS} tags (none: the process only attests it is the job's)")
    for t, p in tags.items():
        check_id("tag", t)
        if p not in R.TAG_POLICIES:
            raise C.ChannelError(f"tag {t!r}: policy must be one of {sorted(R.TAG_POLICIES)}")
    return job, secret, device, dict(tags)


class ChannelServer:
    """The Unix-socket server; ``conn(pid)`` and ``info(pid)`` are what the swappers use."""

    def __init__(self, path: str | os.PathLike, node: str, authorize: Authorize,
                 on_disconnect: Callable[[WorkerInfo], Awaitable[None]] | None = None,
                 on_connect: Callable[[WorkerInfo], None] | None = None):
        self.path, self.node, self.authorize = Path(path), node, authorize
        self.on_disconnect, self.on_connect = on_disconnect, on_connect
        self._conns: dict[int, WorkerConn] = {}
        self._infos: dict[int, WorkerInfo] = {}
        self._lost: dict[int, float] = {}            # pid -> when its channel went (monotonic)
        self._hello = asyncio.Event()                # set (and replaced) at every accepted hello
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()           # reset by start(): from then on workers reconnect

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()               # a previous agent's socket: nobody listens on it any more
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._on_conn, path=str(self.path),
                                                       limit=C.MAX_FRAME + 8)
        # Any local process may connect: who it is comes from SO_PEERCRED and the secret.
        os.chmod(self.path, 0o666)
        log.info("channel_listening", socket=str(self.path), node=self.node)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self._conns.values()):
                c.fail_all("the agent is stopping")
                c.close()
            await self._server.wait_closed()
            self._server = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def conn(self, pid: int) -> WorkerConn | None:
        return self._conns.get(pid)

    def info(self, pid: int) -> WorkerInfo | None:
        return self._infos.get(pid)

    def job_of(self, pid: int) -> str | None:
        """The job that process ``pid`` proved it belongs to, if this very process did."""
        info = self._infos.get(pid)
        if info is None or not procfs.same_process(pid, info.start_time):
            return None
        return info.job

    def prune(self) -> list[int]:
        """Forget what exited processes said (their pids may be reused). Returns them."""
        gone = [p for p, i in self._infos.items() if not procfs.same_process(p, i.start_time)]
        for p in gone:
            self.forget(p)
        return gone

    def forget(self, pid: int) -> None:
        """The process is gone: drop what it said."""
        self._infos.pop(pid, None)
        self._lost.pop(pid, None)
        c = self._conns.pop(pid, None)
        if c is not None:
            c.close()

    def pids(self) -> list[int]:
        return sorted(self._infos)

    def pending_host_bytes(self) -> int:
        """Host bytes that workers' reservations in progress have promised and not pinned yet.

        Host admission subtracts them from free memory from the moment a reservation
        starts: free memory shows a reservation only as its pages are faulted in, so
        while it runs the part already faulted is counted twice (refusing early, never
        admitting what does not fit)."""
        return sum(i.host_reserving for i in self._infos.values())

    def cooperative_pids(self) -> dict[int, str]:
        """pid -> job of the live processes that said hello as cooperative workers (with regions to
        move; a process that only attests has none), connected or not."""
        return {p: i.job for p, i in list(self._infos.items())
                if i.tags and procfs.same_process(p, i.start_time)}

    def lost_at(self, pid: int) -> float | None:
        """When ``pid``'s channel went (monotonic), if it had one and it is closed now."""
        return self._lost.get(pid)

    async def next_hello(self, timeout: float) -> None:
        """Return at the next accepted hello, or after ``timeout`` s."""
        try:
            await asyncio.wait_for(self._hello.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              _PEERCRED.size))
        except OSError:
            writer.close()
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            await self._refuse(writer, "RESOURCE_EXHAUSTED", f"more than {MAX_CONNECTIONS} workers connected")
            return
        try:
            hello = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT_S)
            job, secret, device, tags = _hello_fields(hello)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, C.ChannelError, InvalidIdError, ValueError,
                TypeError) as e:
            await self._refuse(writer, "INVALID_ARGUMENT", f"bad hello: {str(e)[:200]}")
            return
        why = await self.authorize(job, secret)
        if why:
            log.warning("channel_refused", pid=pid, job=job, reason=why)
            await self._refuse(writer, "PERMISSION_DENIED", why)
            return
        info = WorkerInfo(pid, uid, job, device, tags, start_time=procfs.start_time(pid))
        info.update(hello)
        old = self._conns.pop(pid, None)
        if old is not None:
            old.fail_all("replaced by a new connection of the same process")
            old.close()
        conn = WorkerConn(info, reader, writer)
        self._conns[pid], self._infos[pid] = conn, info
        self._lost.pop(pid, None)
        writer.write(C.encode({"type": "welcome", "pid": pid, "node": self.node}))
        await writer.drain()
        log.info("channel_worker_connected", pid=pid, job=job, device=device, tags=tags, paused=info.paused,
                 host_bytes=info.host_bytes)
        said, self._hello = self._hello, asyncio.Event()
        said.set()                                  # ops waiting for this worker go on (nodeagent.reconnects)
        if self.on_connect is not None:
            self.on_connect(info)
        try:
            while True:
                msg = await _read(reader)
                if msg.get("type") == "done":
                    conn.deliver(msg)
                elif msg.get("type") == "state":
                    was = info.host_reserving
                    info.update(msg)            # e.g. the retained host backup, after prepin
                    if was != info.host_reserving:
                        log.info("host_reservation_started" if info.host_reserving else "host_reservation_done",
                                 pid=pid, job=job, reserving=info.host_reserving, host_bytes=info.host_bytes)
        except (asyncio.IncompleteReadError, ConnectionError, C.ChannelError, OSError) as e:
            why = "closed" if isinstance(e, asyncio.IncompleteReadError) else str(e)[:200]
        finally:
            if self._conns.get(pid) is conn:
                del self._conns[pid]
                info.connected = False
                self._lost[pid] = time.monotonic()
            conn.fail_all("the worker closed its channel")
            conn.close()
        log.info("channel_worker_disconnected", pid=pid, job=job, reason=why, paused=info.paused)
        if self.on_disconnect is not None and not info.connected:
            await self.on_disconnect(info)

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        try:
            writer.write(C.encode({"type": "refused", "code": code, "message": message[:300]}))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()
