"""The job side of the cooperative swap: this process moves its own device memory when its agent asks.

    memory = TorchMemory({"weights": "offload", "optimizer": "offload", "kv_cache": "discard"})
    with memory.region("weights"):
        model = build_model().cuda()
    worker = client.cooperate(memory)         # channel to the node agent + RegisterWorker(swap=cooperative)

From then on, while the job is yielded and another job needs the GPU, the
node agent asks this process (over the Unix socket it opened) to *pause*:
``offload`` regions are copied to a host backup that is kept between swaps
and their device memory is released; ``discard`` regions are released and come
back empty. On the next grant the agent asks it to *resume* before Acquire
returns. The copy runs at PCIe speed in this process, instead of a whole-
process CUDA checkpoint at a few GB/s.

The rule that comes with it: touch device memory only while holding a group.
A released tensor touched outside a hold faults (torch-memory-saver) or, when
the agent froze the parked process (the default where the checkpoint backend
can lock it), blocks until the next grant.

``memory`` is anything with the ``SwapMemory`` shape: ``TorchMemory`` (on
torch-memory-saver, imported lazily: PyTorch is not a dependency of the lock),
``CallbackMemory`` (a pause/resume pair of the job's own), or the simulated
device's ``SimCooperativeMemory`` used by the tests and the demo.

The agent's welcome names the SIMULATED device it watches, if any. A process
that opened a simulated device other than that one (``timeslice.sim``) is
refused at once, with both folders named: its memory would never be seen or
moved, and its run would pass while testing nothing.

The channel reconnects by itself (an agent restart is routine) and tells the
new agent which regions are paused, so a parked job is never forgotten.

After each pause the worker measures its *residue* — the device bytes the
process still holds outside its resident regions (its CUDA context, the
allocator's cache, workspaces, tensors made outside any region), where the
memory can say (``residue_bytes()``) — and reports it with the pause's answer
(``residue_bytes``), so the agent can show it and plan with it.

The worker also asks the agent two things, answered by id on the same channel:
room for an allocation that did not fit inside a hold (``make_room``: parked
residue moved off the GPU; ``timeslice.room``), and admission of a pinned host
backup before it is made (``admit_host``: the node's host memory counts every
pool, so the kernel's OOM killer never decides).
"""
from __future__ import annotations

import collections
import itertools
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import structlog
import tenacity

from timeslice import gil
from timeslice.common import channel as C
from timeslice.common import frames as F
from timeslice.errors import WrongDeviceError

log = structlog.get_logger(__name__)

OFFLOAD, DISCARD = "offload", "discard"
POLICIES = (OFFLOAD, DISCARD)
SYNC_TIMEOUT_S = 5.0     # how long announce(sync=True) waits for the agent's report (one refresh: ms)
ROOM_TIMEOUT_S = 120.0   # how long a room request waits (the agent checkpoints residue: ~1.8 GB/s on an H200)
HOST_TIMEOUT_S = 10.0    # how long a host admission waits for the agent's answer
ENV_HOST_WAIT = "TIMESLICE_HOST_WAIT_S"    # how long a backup the host cannot take yet waits for room (0: told at once)


class HostAdmissionRefused(Exception):
    """The node agent did not admit a pinned host backup: the node's host memory cannot take it now.
    Raised to the job before anything is pinned (the kernel's OOM killer must never be the one who decides)."""

    def __init__(self, message: str, need_bytes: int, free_bytes: int):
        super().__init__(message)
        self.need_bytes, self.free_bytes = need_bytes, free_bytes


class SwapMemory(Protocol):
    """What a cooperative worker can release and take back, by tag."""

    tags: Mapping[str, str]                        # tag -> "offload" | "discard"

    def device_id(self) -> str: ...                # e.g. "GPU-<uuid>", or "sim0" on the simulator
    def region_bytes(self) -> dict[str, int]: ...  # device bytes per tag while resident
    def host_bytes(self) -> int: ...               # host backup already allocated (retained)
    # pause/resume may return the bytes they copied (a clean region copies none); None: the
    # worker counts every offload region's size
    def pause(self, tags: Sequence[str]) -> int | None: ...
    def resume(self, tags: Sequence[str]) -> int | None: ...

# Optional, where a memory has them: host_pending_bytes() (a host reservation in progress),
# backup_stats() (copies, clean skips, wrong clean claims), set_state_listener(fn) (called when the
# agent should hear this worker's state again), prepin(background=False) (``background``: the
# reservation on a thread, its pauses waiting for it), residue_bytes() (the device bytes held
# outside the resident regions).


def residue_of(memory) -> int | None:
    """What ``memory`` says the process keeps on the device outside its resident regions; None if it cannot say."""
    measure = getattr(memory, "residue_bytes", None)
    if measure is None:
        return None
    try:
        return max(0, int(measure()))
    except Exception:  # a measure that fails costs the figure, never the swap
        log.warning("residue_measure_failed", exc_info=True)
        return None


def simulated_devices(memory) -> list[str]:
    """The SIMULATED devices (folders) ``memory`` stands on: its own; for an attestation, those the process
    has open (a checkpointed worker's arena); none for a real GPU's memory."""
    own = getattr(memory, "sim_dir", None)
    if callable(own):
        return [str(own())]
    runtime = sys.modules.get("timeslice.sim.runtime")
    if isinstance(memory, Attestation) and runtime is not None:
        return runtime.opened_devices()
    return []


def wrong_device(welcome: Mapping, socket_path: str, ours: Sequence[str]) -> str:
    """Why this worker's SIMULATED device memory (``ours``) is not the agent's device ("" when it is, or none)."""
    if not ours or "sim_dir" not in welcome:       # no simulated memory here (or an agent that does not say)
        return ""
    theirs = str(welcome.get("sim_dir") or "")
    if not theirs:
        return (f"this process's memory is on the SIMULATED device at {ours[0]}, but the node agent at "
                f"{socket_path} runs a real GPU backend and watches no simulated device: nothing this job "
                f"does there would be seen or swapped. Use TorchMemory on the GPU, or a cluster started "
                f"with `timeslice up --backend sim`")
    wrong = [d for d in ours if d != os.path.realpath(theirs)]
    if not wrong:
        return ""
    return (f"this process's SIMULATED device memory is at {wrong[0]}, but the node agent at {socket_path} "
            f"watches the simulated device at {theirs}: nothing this job does there would be seen or swapped. "
            f"Set TIMESLICE_SIM_DIR={theirs} (the folder `timeslice up` prints), or leave it unset to use "
            f"the running local cluster's device")


class CallbackMemory:
    """A pause/resume pair the job supplies, as one offloaded region of ``nbytes``."""

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None], nbytes: int,
                 device: str = "", tag: str = "default", policy: str = OFFLOAD):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self._pause, self._resume, self._nbytes, self._device = pause, resume, int(nbytes), device
        self.tags = {tag: policy}

    def device_id(self) -> str:
        return self._device

    def region_bytes(self) -> dict[str, int]:
        return {t: self._nbytes for t in self.tags}

    def host_bytes(self) -> int:
        return 0

    def pause(self, tags: Sequence[str]) -> None:
        self._pause()

    def resume(self, tags: Sequence[str]) -> None:
        self._resume()


class Attestation:
    """No memory to move: the channel only proves to the agent that this process is the job's.

    The client opens one when it registers a worker swapped by checkpoint, so that a
    job can never have the agent act on a process that is not its own
    (``nodeagent/attestations.py``: the agent trusts the pid the kernel gives it).
    """

    tags: Mapping[str, str] = {}

    def device_id(self) -> str:
        return ""

    def region_bytes(self) -> dict[str, int]:
        return {}

    def host_bytes(self) -> int:
        return 0

    def pause(self, tags: Sequence[str]) -> None:
        raise RuntimeError("this process attests only; it cannot pause")

    def resume(self, tags: Sequence[str]) -> None:
        raise RuntimeError("this process attests only; it cannot resume")


class _Unavailable(Exception):
    """The agent turned the hello away for now (it could not record the attestation yet)."""


class CooperativeWorker:
    """The channel to the node agent and the thread that answers its requests."""

    def __init__(self, job_id: str, secret: str | Callable[[], str], memory: SwapMemory, node: str,
                 socket_path: str | None = None, connect_timeout: float = C.CONNECT_TIMEOUT_S,
                 held: Callable[[], Sequence[tuple[str, int]]] | None = None):
        """``held()``: the (group, token) grants the job holds now, named in a room request."""
        for tag, policy in memory.tags.items():
            if policy not in POLICIES:
                raise ValueError(f"tag {tag!r}: policy must be one of {POLICIES}, got {policy!r}")
        self.job_id, self._secret, self.memory, self.node = job_id, secret, memory, node
        self.path = str(socket_path or C.default_socket_path(node))
        self.connect_timeout = connect_timeout
        self.pid = 0                                   # as the agent sees it (SO_PEERCRED)
        self.paused: list[str] = []                    # tags released now, in pause order
        self.swaps = 0
        self.residue_bytes: int | None = None          # measured after the last pause (None: not measurable)
        self.residues: collections.deque[int] = collections.deque(maxlen=256)   # after each pause, for benchmarks
        # (request, monotonic start, end, bytes moved) of each pause and resume served, for benchmarks
        self.ops: collections.deque[tuple[str, float, float, int]] = collections.deque(maxlen=1024)
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()                    # one request at a time
        self._send_mu = threading.Lock()               # frames from two threads never interleave
        self._syncs = itertools.count(1)
        self._synced: dict[int, threading.Event] = {}  # sync id -> set when the agent answered it
        self._answers: dict[int, dict] = {}             # id -> the agent's answer to a room/host/vouch request
        self.agent_answers: frozenset[str] = frozenset()  # what the agent said it answers (its welcome)
        self.held = held or (lambda: [])

    # -- connection ------------------------------------------------------------------
    def _hello(self) -> dict:
        return F.hello(self.job_id, self._secret() if callable(self._secret) else self._secret,
                       self.memory.device_id(), self.memory.tags, self.paused, self._sizes())

    def connect(self) -> int:
        """Open the channel and introduce this process; returns the pid the agent sees.

        A hello turned away as UNAVAILABLE (the agent could not record the attestation in etcd
        yet) is said again with jittered backoff (tenacity) within ``connect_timeout``."""
        deadline = time.monotonic() + self.connect_timeout
        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type(_Unavailable),
                                     wait=tenacity.wait_random_exponential(multiplier=0.1, max=2.0),
                                     stop=tenacity.stop_after_delay(self.connect_timeout), reraise=True)
        try:
            s, reply = retrying(self._say_hello, deadline)
        except _Unavailable as e:
            raise C.ChannelError(f"the node agent refused this worker: {e}") from None
        if reply.get("type") != F.WELCOME:
            s.close()
            raise C.ChannelError(f"the node agent refused this worker: {reply.get('code', '?')}: "
                                 f"{str(reply.get('message', ''))[:300]}")
        wrong = wrong_device(reply, self.path, simulated_devices(self.memory))
        if wrong:
            s.close()
            raise WrongDeviceError(wrong)
        s.settimeout(None)
        self._sock, self.pid = s, int(reply["pid"])
        answers = reply.get("answers")
        self.agent_answers = frozenset(str(x) for x in answers) if isinstance(answers, list) else frozenset()
        log.info("cooperative_connected", job=self.job_id, pid=self.pid, socket=self.path, paused=self.paused)
        return self.pid

    def _say_hello(self, deadline: float) -> tuple[socket.socket, dict]:
        """One connect and hello; (socket, the agent's reply). ``_Unavailable`` if turned away for now."""
        try:
            s = C.connect(self.path, max(0.05, deadline - time.monotonic()))
        except OSError as e:
            raise C.ChannelError(f"cannot reach the node agent at {self.path}: {e}") from None
        try:
            C.send(s, self._hello())
            reply = C.recv(s)
        except (OSError, C.ChannelError) as e:
            s.close()
            raise C.ChannelError(f"cannot reach the node agent at {self.path}: {e}") from None
        if reply.get("type") == F.REFUSED and reply.get("code") == "UNAVAILABLE":
            s.close()
            raise _Unavailable(f"UNAVAILABLE: {str(reply.get('message', ''))[:300]}")
        return s, reply

    def start(self) -> CooperativeWorker:
        """Connect (if not yet) and serve the agent's requests on a daemon thread."""
        if self._sock is None:
            self.connect()
        listen = getattr(self.memory, "set_state_listener", None)
        if listen is not None:
            listen(self.announce)                      # a reservation, a region that grew: the agent hears it
        for name, fn in (("set_room_maker", self.make_room), ("set_host_admission", self.admit_host)):
            hook = getattr(self.memory, name, None)
            if hook is not None:
                hook(fn)
        self._thread = threading.Thread(target=self._serve, name="timeslice-cooperative", daemon=True)
        self._thread.start()
        return self

    def prepin(self, background: bool = False) -> None:
        """Reserve the memory's host backup now, telling the agent when it starts and when it is done,
        so that its host admission counts the reservation from the start (``timeslice.pinned``);
        ``background``: returns at once, the reservation runs on (its end is told through the state
        listener; a pause waits for it)."""
        prepin = getattr(self.memory, "prepin", None)
        if prepin is not None:
            if background:
                prepin(background=True)
            else:
                prepin()
        self.announce()

    def announce(self, sync: bool = False, timeout: float = SYNC_TIMEOUT_S) -> bool:
        """Tell the agent what changed on our side (e.g. the host backup allocated by prepin),
        so its host-memory admission counts the retained backup instead of asking for it again.

        ``sync``: wait (at most ``timeout`` s) until the agent's report to etcd counts it. Memory
        that grew inside a hold (an optimizer's first step) must be on that report before the hold
        ends, or the next grant is planned on an older one, as if the memory were still free.
        Returns whether the agent confirmed it (always True without ``sync``)."""
        s = self._sock
        if s is None:
            return not sync                            # the serving thread reconnects; its hello says it all
        rid, done = (next(self._syncs), threading.Event()) if sync else (0, None)
        if done is not None:
            self._synced[rid] = done
        try:
            with self._send_mu:
                C.send(s, F.state(self._state(), rid))
            if done is None:
                return True
            if not done.wait(timeout):
                log.warning("cooperative_state_unconfirmed", job=self.job_id, timeout_s=timeout,
                            hint="the node agent did not confirm the new sizes in time; the next grant "
                                 "may be planned without them")
                return False
            return True
        except (OSError, C.ChannelError):
            return False
        finally:
            self._synced.pop(rid, None)

    # -- what the worker asks the agent ----------------------------------------------------
    def _ask(self, frame: Callable[[int], dict], timeout: float) -> dict | None:
        """Send a request to the agent and wait for its answer; None: no channel, an agent that does not
        answer this request (its welcome did not name it: an older agent), or no answer in time. Never
        from the serving thread: it reads the answer."""
        s = self._sock
        if s is None or threading.current_thread() is self._thread:
            return None
        rid, done = next(self._syncs), threading.Event()
        if frame(rid).get("type") not in self.agent_answers:
            return None
        self._synced[rid] = done
        try:
            with self._send_mu:
                C.send(s, frame(rid))
            if not done.wait(timeout):
                return None
            return self._answers.pop(rid, None)
        except (OSError, C.ChannelError):
            return None
        finally:
            self._synced.pop(rid, None)
            self._answers.pop(rid, None)

    def vouch(self, pid: int, timeout: float = SYNC_TIMEOUT_S) -> str:
        """Have the agent record process ``pid`` (one this process started: a rank) as this job's, so
        that lockd knows it before the job registers it; "" once recorded, else why not."""
        got = self._ask(lambda rid: F.vouch(rid, pid), timeout)
        if got is None:
            return (f"the node agent did not answer within {timeout:g} s" if F.VOUCH in self.agent_answers
                    else "the node agent records no other process (an older agent), or no channel to it now")
        return "" if not got.get("code") else f"{got['code']}: {str(got.get('message', ''))[:300]}"

    def make_room(self, device: str, nbytes: int):
        """Ask the agent to move parked jobs' residue off ``device`` so that ``nbytes`` more fit (inside
        a hold); returns ``timeslice.room.RoomAnswer`` (freed 0 and why, when it could not)."""
        from timeslice.room import RoomAnswer
        held = [(str(g), int(t)) for g, t in self.held()]
        got = self._ask(lambda rid: F.room(rid, device or self.memory.device_id(), nbytes, held), ROOM_TIMEOUT_S)
        if got is None:
            return RoomAnswer(message="the node agent did not answer the room request (no channel, or an "
                                      "older agent)")
        return RoomAnswer.from_frame(got)

    def admit_host(self, nbytes: int) -> None:
        """Have the agent admit ``nbytes`` of pinned host backup before it is made; HostAdmissionRefused
        if the node's host memory cannot take it (after waiting up to $TIMESLICE_HOST_WAIT_S for room).
        An agent that does not answer (older) leaves the pool's own free-memory check to decide."""
        if nbytes <= 0 or threading.current_thread() is self._thread:
            return                     # a pause's first pinning: the agent admitted the snapshot's host need
        try:
            wait = float(os.environ.get(ENV_HOST_WAIT, "") or 0)
        except ValueError:
            wait = 0.0
        deadline = time.monotonic() + max(0.0, wait)
        delay = 0.5
        while True:
            got = self._ask(lambda rid: F.host(rid, nbytes), HOST_TIMEOUT_S)
            if got is None or got.get("ok"):
                return
            free = int(got.get("free_bytes") or 0)
            if time.monotonic() + delay > deadline:
                raise HostAdmissionRefused(
                    f"the node's host memory cannot take a {nbytes}-byte pinned backup now ({free} bytes free "
                    f"as the node agent counts it): {str(got.get('message', ''))[:300]}", nbytes, free)
            log.info("host_admission_waiting", job=self.job_id, need_bytes=nbytes, free_bytes=free)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    def close(self) -> None:
        self._closed.set()
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- serving ---------------------------------------------------------------------
    def _serve(self) -> None:
        delay = 0.1
        while not self._closed.is_set():
            s = self._sock
            try:
                if s is None:
                    self.connect()
                    delay = 0.1
                    continue
                msg = C.recv(s)
                if msg.get("type") in F.ANSWERS:         # an answer to something we asked, not a request
                    rid = msg.get("id")
                    ev = self._synced.get(rid) if type(rid) is int else None
                    if ev is not None and type(rid) is int:
                        if msg.get("type") != F.SYNCED:
                            self._answers[rid] = msg
                        ev.set()
                    continue
                reply = self.handle(msg)
                with self._send_mu:
                    C.send(s, reply)
            except (OSError, C.ChannelError) as e:
                if self._closed.is_set():
                    return
                if s is not None:
                    s.close()
                    self._sock = None
                    log.warning("cooperative_channel_lost", job=self.job_id, error=str(e), paused=self.paused)
                # An agent restart is routine: come back with jitter so a node's workers do not stampede.
                self._closed.wait(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    def handle(self, msg: dict) -> dict:
        """One request in, one ``done`` out. Never raises for the memory's failure: it is reported."""
        kind, rid = msg.get("type"), msg.get("id")
        t0 = time.monotonic()
        with self._mu, gil.prompt_handoff():       # beside the job's busy main thread (timeslice.gil)
            try:
                if kind == F.PAUSE:
                    tags = msg.get("tags")
                    moved, released, acted = self._pause(None if tags is None else [str(t) for t in tags])
                    self.residue_bytes = residue_of(self.memory)
                    if self.residue_bytes is not None:
                        self.residues.append(self.residue_bytes)
                elif kind == F.RESUME:
                    moved, released, acted = self._resume()
                elif kind == F.PING:
                    moved, released, acted = 0, 0, []
                else:
                    return F.done(rid, self._state(), ok=False, code="INVALID_ARGUMENT",
                                  error=f"unknown request {str(kind)[:40]!r}")
            except Exception as e:  # the agent reports it to the waiting job
                log.exception("cooperative_request_failed", job=self.job_id, request=kind)
                return F.done(rid, {"elapsed_ms": (time.monotonic() - t0) * 1000, **self._state()}, ok=False,
                              code="INTERNAL", error=f"{type(e).__name__}: {str(e)[:500]}")
        ms = (time.monotonic() - t0) * 1000
        if kind != F.PING:
            self.swaps += 1
            self.ops.append((str(kind), t0, t0 + ms / 1000, int(moved or 0)))
            log.info(f"cooperative_{kind}d", job=self.job_id, tags=acted, bytes_moved=moved,
                     device_bytes=released, elapsed_ms=round(ms, 2),
                     **({"residue_bytes": self.residue_bytes} if kind == F.PAUSE else {}))
        return F.done(rid, {"bytes_moved": moved, "device_bytes": released, "elapsed_ms": ms, "tags": acted,
                            **self._state()})

    def _sizes(self) -> dict:
        m = self.memory
        out = {"host_bytes": m.host_bytes(), "region_bytes": m.region_bytes()}
        pending = getattr(m, "host_pending_bytes", None)
        if pending is not None:
            out["host_reserving"] = int(pending())
        stats = getattr(m, "backup_stats", None)
        if stats is not None:
            out["backup"] = dict(stats())
        return out

    def _state(self) -> dict:
        out = {"state": "paused" if self.paused else "running", "paused": list(self.paused), **self._sizes()}
        if self.paused and self.residue_bytes is not None:
            out["residue_bytes"] = self.residue_bytes   # what stays on the device while parked
        return out

    def _moved(self, got, tags: Sequence[str], sizes: Mapping[str, int]) -> int:
        """What the memory says it copied, else every offload region's size."""
        if isinstance(got, int):
            return got
        return sum(sizes.get(t, 0) for t in tags if self.memory.tags[t] == OFFLOAD)

    def _pause(self, tags: list[str] | None) -> tuple[int, int, list[str]]:
        order = list(self.memory.tags) if tags is None else tags
        unknown = [t for t in order if t not in self.memory.tags]
        if unknown:
            raise ValueError(f"unknown tags {unknown[:8]}")
        todo = [t for t in order if t not in self.paused]
        sizes = self.memory.region_bytes()
        done: list[str] = []
        moved = 0
        try:
            for t in todo:                       # one tag at a time, so a failure knows what to undo
                moved += self._moved(self.memory.pause([t]), [t], sizes)
                done.append(t)
        except Exception:
            if done:                             # all or nothing: give back what this call released
                self.memory.resume(done)
            raise
        self.paused.extend(done)
        return moved, sum(sizes.get(t, 0) for t in done), done

    def _resume(self) -> tuple[int, int, list[str]]:
        todo = list(self.paused)
        if not todo:
            return 0, 0, []
        got = self.memory.resume(todo)
        self.paused.clear()
        sizes = self.memory.region_bytes()
        return self._moved(got, todo, sizes), sum(sizes.get(t, 0) for t in todo), todo
