"""Processes of the local cluster: spawn detached, log to a file, wait until ready, stop.

Every child runs in a session of its own, so a Ctrl-C in the terminal reaches
only the launcher, which then stops the children in order (agent, lockd,
etcd). Nothing here kills a process at interpreter exit: with ``--detach``
the cluster must outlive the launcher. A child is identified by pid *and*
start time, so a stop issued later (``timeslice up --stop``) never signals a
process that merely reuses the pid.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from timeslice.common.logs import parse_ready


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks (field 22 of /proc/<pid>/stat); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
        return None
    if rest[0] in ("Z", "X", "x"):
        return None
    return int(rest[19])


def same_process(pid: int, started: int | None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or started == now)


class ChildFailed(RuntimeError):
    """A child exited or did not get ready; the message carries its log's tail."""


@dataclass
class Child:
    """One server process of the cluster."""

    kind: str                      # etcd | lockd | nodeagent
    name: str                      # m0, r1, the node name
    argv: list[str]
    log_path: str
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    pid: int = 0
    started: int | None = None
    log_offset: int = 0            # where this run's lines start in the (appended) log
    info: dict = field(default_factory=dict)   # what readiness found out (port, backend, ...)

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
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.pid = self.proc.pid
        self.started = start_time(self.pid)
        return self

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
                raise ChildFailed(f"{self.kind} {self.name} not ready after {timeout:.0f}s; "
                                  f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, grace: float) -> bool:
        """SIGTERM (and SIGCONT, should it be paused), SIGKILL after ``grace`` s. True if it stopped by itself."""
        if not self.alive():
            self._reap()
            return True
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self.alive():
                self._reap()
                return True
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        end = time.monotonic() + 10
        while self.alive() and time.monotonic() < end:
            time.sleep(0.05)
        self._reap()
        return False

    def _signal(self, sig: int) -> None:
        # The child leads its own process group (start_new_session): signal the
        # group, so helpers it forked go too.
        try:
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(1)
            except subprocess.TimeoutExpired:
                pass

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "pid": self.pid, "start_time": self.started,
                "log": self.log_path, "argv": self.argv, **self.info}

    @classmethod
    def from_dict(cls, d: dict) -> Child:
        info = {k: v for k, v in d.items() if k not in ("kind", "name", "pid", "start_time", "log", "argv")}
        return cls(d["kind"], d["name"], list(d.get("argv", [])), d["log"], pid=int(d["pid"]),
                   started=d.get("start_time"), info=info)


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
