"""One server process of a local cluster: spawn detached, log to a file, wait until ready, stop.

Every child runs in a session of its own, so a Ctrl-C in the terminal reaches
only the launcher, which then stops the children in order (agent, lockd,
etcd). Nothing here kills a process at interpreter exit: with ``--detach``
the cluster must outlive the launcher (the test harness adds that on top).
A child known only from ``cluster.json`` (another process started it) is
identified by pid *and* start time (see ``pids``).

The servers print one ``<TAG> key=value ...`` line once they serve (see
``timeslice.common.server.logs``); every other line of their logs is a JSON event.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

from timeslice.common.server.logs import parse_ready
from timeslice.launcher.pids import same_process, signal_tree, start_time, terminate

__all__ = ["Child", "ChildFailed", "ChildNotReady", "log_events", "read_ready_line", "same_process",
           "start_time", "stop_all"]


class ChildFailed(RuntimeError):
    """A child exited or did not get ready; the message carries its log's tail."""


class ChildNotReady(ChildFailed, TimeoutError):
    """A child still runs but did not get ready in time."""


class Child:
    """One server process of the cluster: ``kind`` etcd | lockd | nodeagent, ``name`` m0, r1, a node."""

    def __init__(self, kind: str, name: str, argv: list[str], log_path: str, env: dict[str, str] | None = None,
                 *, pid: int = 0, started: int | None = None, info: dict | None = None):
        self.kind, self.name, self.argv, self.log_path, self.env = kind, name, list(argv), log_path, env
        self.proc: subprocess.Popen | None = None
        self.pid = pid
        self.started = started
        self.log_offset = 0            # where this run's lines start in the (appended) log
        self.info: dict = dict(info or {})   # what readiness found out (port, backend, ...)

    def spawn(self) -> Child:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            # One JSON line, like every other line of the log (lockd's, the agent's, etcd's).
            ident = {"lockd": "replica", "nodeagent": "node"}.get(self.kind, "name")
            log.write((json.dumps({"event": "launcher_spawned", "component": self.kind, ident: self.name,
                                   "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "argv": self.argv}) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.spawn_env(), start_new_session=True)
        self.pid = self.proc.pid
        self.started = start_time(self.pid)
        return self

    def spawn_env(self) -> dict[str, str] | None:
        """The child's environment (None: ours)."""
        return self.env

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return bool(self.pid) and same_process(self.pid, self.started)

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"

    def wait_ready(self, probe: Callable[[Child], dict | None], timeout: float,
                   interrupted: Callable[[], bool] = lambda: False) -> dict:
        """Poll ``probe`` until it returns a dict (stored in ``info``); raise ChildFailed if it dies."""
        deadline = time.monotonic() + timeout
        while True:
            got = probe(self)
            if got is not None:
                self.info.update(got)
                return self.info
            if not self.alive():
                raise ChildFailed(f"{self.kind} {self.name} exited (rc={self.returncode()}) "
                                  f"while starting; last lines of {self.log_path}:\n{self.log_tail()}")
            if interrupted():
                raise KeyboardInterrupt
            if time.monotonic() >= deadline:
                raise ChildNotReady(f"{self.kind} {self.name} not ready after {timeout:.0f}s; "
                                    f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, grace: float) -> None:
        """SIGTERM to its group (and SIGCONT, should it be paused), SIGKILL after ``grace`` s; reaped."""
        stop_all([self], grace)

    def handle(self) -> subprocess.Popen | int | None:
        """What ``pids.terminate`` takes: our Popen, else the pid if it is still the same process."""
        if self.proc is not None:
            return self.proc
        return self.pid if self.alive() else None

    def kill(self) -> None:
        """SIGKILL to its group: a crash, no chance to clean up; reaped."""
        if self.proc is not None and self.proc.poll() is None:
            signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        elif self.proc is None and self.alive():
            signal_tree(self.pid, signal.SIGKILL)

    def signal(self, sig: int) -> None:
        """``sig`` to its group (SIGSTOP/SIGCONT pause and resume it), if it still runs."""
        if self.alive():
            signal_tree(self.pid, sig)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "pid": self.pid, "start_time": self.started,
                "log": self.log_path, "argv": self.argv, **self.info}

    @classmethod
    def from_dict(cls, d: dict) -> Child:
        info = {k: v for k, v in d.items() if k not in ("kind", "name", "pid", "start_time", "log", "argv")}
        return Child(d["kind"], d["name"], list(d.get("argv", [])), d["log"], pid=int(d["pid"]),
                     started=d.get("start_time"), info=info)


def stop_all(children: list[Child], grace: float) -> None:
    """Stop them together: all are signalled, then awaited, one grace period in all."""
    handles = [h for h in (c.handle() for c in children) if h is not None]
    if handles:
        terminate(handles, grace)


def log_events(path: str, offset: int = 0) -> Iterator[dict]:
    """The JSON events of a server's log, from ``offset`` on (other lines are skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.readlines()
    except FileNotFoundError:
        return
    for line in lines:
        if line.startswith(b"{"):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_ready_line(path: str, tag: bytes, offset: int = 0) -> dict | None:
    """The ``key=value`` fields of the last line starting with ``tag`` in ``path`` (from ``offset``), or None."""
    found = None
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f:
                fields = parse_ready(line, tag.decode())
                if fields is not None:
                    found = dict(fields)
    except FileNotFoundError:
        return None
    return found
