"""A project server (lockd, nodeagent) run as a real process for tests, chaos and benchmarks.

The server prints ``<READY_TAG> port=N ...`` once it serves; ``start`` waits
for that line *in this run's part of the log* (a restart appends to the same
file). Processes run in their own session, so signals reach their children;
every one is tracked and killed at exit even if a test dies.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from timeslice.common.logs import parse_ready
from timeslice.testing.procs import signal_tree, terminate, track, untrack


class ServerProcess:
    READY_TAG = b""
    NAME = "server"

    def __init__(self, log_path: str, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log_start = 0

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return self.NAME

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def start(self, timeout: float = 30.0):
        try:
            self._log_start = os.path.getsize(self.log_path)
        except FileNotFoundError:
            self._log_start = 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        log.close()
        track(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited rc={self.proc.returncode}:\n{self.log_tail()}")
            port = self._ready_port()
            if port:
                self.port = port
                return self
            time.sleep(0.05)
        raise TimeoutError(f"{self.label} not ready in {timeout}s:\n{self.log_tail()}")

    def _ready_port(self) -> int:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                for line in f:
                    fields = parse_ready(line, self.READY_TAG.decode())
                    if fields:
                        return int(fields["port"])
        except FileNotFoundError:
            pass
        return 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            terminate([self.proc], grace)
            untrack(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            untrack(self.proc.pid)

    def pause(self) -> None:
        signal_tree(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        signal_tree(self.pid, signal.SIGCONT)

    def restart(self, timeout: float = 30.0):
        if self.alive():
            self.stop()
        return self.start(timeout)

    def __enter__(self):
        return self.start() if not self.alive() else self

    def __exit__(self, *exc) -> None:
        if self.alive():
            self.resume()
            self.stop()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self, name: str | None = None, **match) -> list[dict]:
        """Structured log events (every run), by ``event`` name and key=value matches."""
        out = []
        try:
            f = open(self.log_path, "rb")
        except FileNotFoundError:
            return out
        with f:
            for line in f:
                if not line.startswith(b"{"):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if (name is None or ev.get("event") == name) and all(ev.get(k) == v for k, v in match.items()):
                    out.append(ev)
        return out

    def wait_events(self, name: str, count: int = 1, timeout: float = 10.0, **match) -> list[dict]:
        """The matching events once there are at least ``count`` of them (a server may log
        an outcome just after writing it to etcd: a test that saw the write must wait)."""
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events(name, **match)
            if len(evs) >= count:
                return evs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(evs)} of {count} {name} {match} from {self.label}:\n{self.log_tail()}")
            time.sleep(0.05)

    def wait_event(self, name: str, timeout: float = 10.0, **match) -> dict:
        return self.wait_events(name, 1, timeout, **match)[-1]
