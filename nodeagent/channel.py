"""The agent's end of the node-local channel to cooperative workers (``timeslice.common.channel``).

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
size and nesting, hello fields, connections in total, requests in flight.
Connections that have not said hello wait in the ``Lobby`` (bounded per
process, per user and in total; the oldest of a flooder is evicted, never a
newcomer refused), at most ``HELLO_TIMEOUT_S``. A frame out of protocol
(``timeslice.common.frames``) gets a refusal frame, and the disconnect handling
(which lifts a paused worker's freeze) runs however a connection ends.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from timeslice.common import channel as C
from timeslice.common import frames as F
from timeslice.common import procfs
from timeslice.common.errors import InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.nodeagent.listener import Listener, Pending
from timeslice.nodeagent.lobby import Lobby, Seat

log = structlog.get_logger(__name__)

HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024

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
    residue_bytes: int | None = None   # device bytes the worker still held after its last pause (its measure)
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
        if not self.paused:
            self.residue_bytes = None          # running: everything it has is on the device anyway
        elif isinstance(msg.get("residue_bytes"), int) and not isinstance(msg["residue_bytes"], bool):
            self.residue_bytes = max(0, msg["residue_bytes"])


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
    if msg.get("type") != F.HELLO:
        raise C.ChannelError("the first frame must be a hello")
    job, secret, device = msg.get("job"), msg.get("secret"), msg.get("device", "")
    job = check_id("job", job)
    if not isinstance(secret, str) or not 0 < len(secret) <= 256:
        raise C.ChannelError("hello needs the job's session secret")
    if not isinstance(device, str) or len(device) > 128:
        raise C.ChannelError("device must be a string of at most 128 characters")
    tags = msg.get("tags")
    if not isinstance(tags, dict) or len(tags) > F.MAX_TAGS:
        raise C.ChannelError(f"hello needs at most {F.MAX_TAGS} tags (none: the process only attests it is the job's)")
    for t, p in tags.items():
        check_id("tag", t)
        if p not in R.TAG_POLICIES:
            raise C.ChannelError(f"tag {t!r}: policy must be one of {sorted(R.TAG_POLICIES)}")
    return job, secret, device, dict(tags)


def _room_for_connections(n: int) -> None:
    """Raise the soft file-descriptor limit (up to the hard one) so ``n`` channel connections
    fit beside etcd's and gRPC's: a 1024 default would run out first (accept fails, the backlog fills)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 512
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as e:
            log.warning("fd_limit_unchanged", soft=soft, hard=hard, error=str(e))


class ChannelServer:
    """The Unix-socket server; ``conn(pid)`` and ``info(pid)`` are what the swappers use."""

    def __init__(self, path: str | os.PathLike, node: str, authorize: Authorize,
                 on_disconnect: Callable[[WorkerInfo], Awaitable[None]] | None = None,
                 on_connect: Callable[[WorkerInfo], None] | None = None, lobby: Lobby | None = None,
                 on_attested: Callable[[WorkerInfo], Awaitable[None]] | None = None,
                 on_state: Callable[[WorkerInfo], Awaitable[None]] | None = None,
                 on_ask: Callable[[WorkerInfo, dict], Awaitable[dict]] | None = None):
        self.path, self.node, self.authorize = Path(path), node, authorize
        self.on_disconnect, self.on_connect = on_disconnect, on_connect
        self.on_state = on_state                     # awaited before a ``synced`` answer (the fresh report)
        self.on_attested = on_attested               # awaited before the welcome (nodeagent/attestations.py)
        self.on_ask = on_ask                         # a worker's room / host request -> the answer frame
        self._conns: dict[int, WorkerConn] = {}
        self._infos: dict[int, WorkerInfo] = {}
        self._lost: dict[int, float] = {}            # pid -> when its channel went (monotonic)
        self._hello = asyncio.Event()                # set (and replaced) at every accepted hello
        self.lobby = lobby or Lobby()                # connections before their hello, bounded
        self._door = Listener(self.path, self.lobby, self._on_hello, HELLO_TIMEOUT_S)
        self._admitting: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()           # reset by start(): from then on workers reconnect

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        _room_for_connections(MAX_CONNECTIONS + self.lobby.total)
        await self._door.start()
        log.info("channel_listening", socket=str(self.path), node=self.node)

    async def stop(self) -> None:
        await self._door.close()
        for t in list(self._admitting):
            t.cancel()
        await asyncio.gather(*self._admitting, return_exceptions=True)
        for c in list(self._conns.values()):
            c.fail_all("the agent is stopping")
            c.close()

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

    def attested(self) -> dict[int, tuple[str, int | None]]:
        """{pid: (job, process start time)} of every process that proved its job and still runs."""
        return {p: (i.job, i.start_time) for p, i in self._infos.items() if procfs.same_process(p, i.start_time)}

    def _on_hello(self, seat: Seat, sock: socket.socket, body: bytes) -> None:
        """The door has a whole hello from a connection in the lobby: check it, on a task of its own."""
        pending = seat.handle
        assert isinstance(pending, Pending)
        holder: dict[str, asyncio.StreamWriter] = {}

        def evicted() -> None:                  # the lobby gave its seat away while its job was checked
            seat.evicted = True
            w = holder.get("writer")
            if w is not None:
                self._refuse_now(w, "RESOURCE_EXHAUSTED", seat.why)
        pending.on_evict = evicted
        task = asyncio.get_running_loop().create_task(self._on_conn(seat, sock, body, holder),
                                                      name=f"channel-hello-{seat.pid}")
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    async def _on_conn(self, seat: Seat, sock: socket.socket, body: bytes,
                       holder: dict[str, asyncio.StreamWriter]) -> None:
        try:
            try:
                reader, writer = await asyncio.open_unix_connection(sock=sock, limit=C.MAX_FRAME + 8)
            except OSError:
                sock.close()
                return
            holder["writer"] = writer
            if seat.evicted:
                writer.close()
                return
            admitted = await self._admit(reader, writer, seat, body)
        finally:
            self.lobby.leave(seat)
        if admitted is not None:
            await self._serve(admitted)

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seat: Seat,
                     body: bytes) -> WorkerConn | None:
        """Check the hello, authorize its job, welcome the worker; None if it was turned away."""
        pid, uid = seat.pid, seat.uid
        if len(self._conns) >= MAX_CONNECTIONS:
            await self._refuse(writer, "RESOURCE_EXHAUSTED", f"more than {MAX_CONNECTIONS} workers connected")
            return None
        try:
            hello = C.decode(body)
            job, secret, device, tags = _hello_fields(hello)
            F.check_state(hello)
        except (C.ChannelError, InvalidIdError, ValueError, TypeError) as e:
            await self._refuse(writer, "INVALID_ARGUMENT", f"bad hello: {str(e)[:200]}")
            return None
        why = await self.authorize(job, secret)
        if seat.evicted:                        # its place went to a newcomer while etcd was read
            writer.close()
            return None
        if why:
            log.warning("channel_refused", pid=pid, job=job, reason=why)
            await self._refuse(writer, "PERMISSION_DENIED", why)
            return None
        info = WorkerInfo(pid, uid, job, device, tags, start_time=procfs.start_time(pid))
        info.update(hello)
        old = self._conns.pop(pid, None)
        if old is not None:
            old.fail_all("replaced by a new connection of the same process")
            old.close()
        conn = WorkerConn(info, reader, writer)
        self._conns[pid], self._infos[pid] = conn, info
        self._lost.pop(pid, None)
        if self.on_attested is not None:
            await self.on_attested(info)        # lockd must know before the job registers the pid
        try:
            writer.write(C.encode(F.welcome(pid, self.node, F.ASKS if self.on_ask is not None else ())))
            await writer.drain()
        except (ConnectionError, OSError):
            pass                                # the read in _serve sees it closed; the disconnect path runs
        log.info("channel_worker_connected", pid=pid, job=job, device=device, tags=tags, paused=info.paused,
                 host_bytes=info.host_bytes)
        said, self._hello = self._hello, asyncio.Event()
        said.set()                                  # ops waiting for this worker go on (nodeagent.reconnects)
        if self.on_connect is not None:
            self.on_connect(info)
        return conn

    async def _sync(self, conn: WorkerConn, sync: int) -> None:
        """A state frame asked to be counted before the worker goes on (its region grew inside a
        hold): the report to etcd is made first, then ``synced``. Without it, the next grant could be
        planned on a report from before the growth and put another job on a full device. One
        connection's frames are read one at a time, so a peer cannot stack up refreshes."""
        if self.on_state is not None:
            try:
                await self.on_state(conn.info)
            except Exception as e:  # the worker waits a bounded time, then goes on and says so
                log.warning("state_sync_failed", pid=conn.info.pid, job=conn.info.job, error=str(e)[:200])
                return
        conn.writer.write(C.encode(F.synced(sync)))
        await conn.writer.drain()

    async def _ask(self, conn: WorkerConn, msg: dict) -> None:
        """A worker's request (room inside its hold, a host backup's admission), answered by its id. One
        connection's frames are read one at a time: a worker has one request in flight at most."""
        if self.on_ask is None:
            reply = (F.roomed(msg["id"], 0, -1, [], "this agent makes no room") if msg["type"] == F.ROOM
                     else F.hosted(msg["id"], True, -1, "this agent does not admit host backups"))
        else:
            try:
                reply = await self.on_ask(conn.info, msg)
            except Exception as e:  # the worker is told; its channel stays up
                log.exception("channel_ask_failed", pid=conn.info.pid, job=conn.info.job, ask=msg["type"])
                why = f"the node agent failed: {type(e).__name__}: {str(e)[:200]}"
                reply = (F.roomed(msg["id"], 0, -1, [], why) if msg["type"] == F.ROOM
                         else F.hosted(msg["id"], False, -1, why))
        conn.writer.write(C.encode(reply))
        await conn.writer.drain()

    async def _serve(self, conn: WorkerConn) -> None:
        """A welcomed worker's frames until it leaves; the disconnect handling runs however it ends."""
        info, why = conn.info, "closed"
        try:
            while True:
                msg = await _read(conn.reader)
                F.check_frame(msg)
                if msg["type"] == F.DONE:
                    conn.deliver(msg)
                elif msg["type"] == F.STATE:
                    was = info.host_reserving
                    info.update(msg)            # e.g. the retained host backup, after prepin
                    if was != info.host_reserving:
                        log.info("host_reservation_started" if info.host_reserving else "host_reservation_done",
                                 pid=info.pid, job=info.job, reserving=info.host_reserving,
                                 host_bytes=info.host_bytes)
                    if msg.get("sync") is not None:
                        await self._sync(conn, msg["sync"])
                elif msg["type"] in F.ASKS:
                    await self._ask(conn, msg)
        except asyncio.IncompleteReadError:
            pass
        except C.ChannelError as e:             # out of protocol: say why, then cut it off
            why = str(e)[:200]
            log.warning("channel_frame_refused", pid=info.pid, job=info.job, reason=why)
            await self._refuse(conn.writer, "INVALID_ARGUMENT", f"bad frame: {why}")
        except (ConnectionError, OSError) as e:
            why = str(e)[:200]
        except Exception as e:  # an input nobody foresaw must not skip the cleanup: refuse, then clean up
            why = f"{type(e).__name__}: {str(e)[:200]}"
            log.exception("channel_frame_failed", pid=info.pid, job=info.job)
            await self._refuse(conn.writer, "INTERNAL", "the agent could not handle a frame")
        finally:
            if self._conns.get(info.pid) is conn:
                del self._conns[info.pid]
                info.connected = False
                self._lost[info.pid] = time.monotonic()
            conn.fail_all("the worker closed its channel")
            conn.close()
        log.info("channel_worker_disconnected", pid=info.pid, job=info.job, reason=why, paused=info.paused)
        if self.on_disconnect is not None and not info.connected:
            await self.on_disconnect(info)

    @staticmethod
    def _refuse_now(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        """Say why and close, without waiting for the peer to read it."""
        try:
            writer.write(C.encode(F.refused(code, message)))
        except (ConnectionError, OSError, RuntimeError):
            pass
        writer.close()

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        try:
            writer.write(C.encode(F.refused(code, message)))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()
