"""Fault injection over a project server (lockd, nodeagent) that the launcher runs, for tests and chaos.

The process itself is the launcher's (``timeslice.launcher.servers``: command
line, log file, readiness). This mixin adds what tests need on top: ``start``
waits until it serves (a restart appends to the same log; only this run's part
counts), ``kill`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT), ``restart``
under the same identity, the structured events of its log, and tracking: every
process is killed at exit even if a test dies.
"""
from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from timeslice.launcher.procs import log_events
from timeslice.testing.procs import terminate, track, untrack, wait_stopped

if TYPE_CHECKING:
    # What the mixin is mixed into, for the type checker only (at run time the launcher class
    # follows it in the subclass's bases, so ``super()`` reaches it).
    from timeslice.launcher.servers import _Server as _Launched
else:
    _Launched = object


class ServerProcess(_Launched):
    """Mixed in before a launcher server class: ``class LockdProcess(ServerProcess, LockdReplica)``."""

    NAME = "server"
    env: dict[str, str] | None      # here: what a test adds to our environment (it may change it before start)
    etcd_endpoints: str             # the launcher class's; a restart uses what is set then

    @property
    def endpoints(self) -> str:
        return self.etcd_endpoints

    @endpoints.setter
    def endpoints(self, value: str) -> None:     # e.g. through relays that a scenario can cut
        self.etcd_endpoints = value

    @property
    def label(self) -> str:
        return f"{self.NAME} {self.name}"

    def spawn_env(self) -> dict[str, str]:
        # The environment as it is at each start (tests set the admin token, sim dirs, ... before it).
        return {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}

    def spawn(self):
        super().spawn()
        assert self.proc is not None     # spawned just now
        track(self.proc)
        return self

    def start(self, timeout: float = 30.0):
        """Spawn and wait until it serves: RuntimeError if it exits, TimeoutError if it is not ready in time."""
        self.spawn()
        self.wait_serving(timeout)
        return self

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            terminate([self.proc], grace)

    def kill(self) -> None:
        if self.proc is not None:
            super().kill()
            untrack(self.proc.pid)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        if self.proc is not None:
            wait_stopped(self.proc.pid)      # returns once it is really silent (testing/procs.py)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

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
        return super().log_tail(n)

    def events(self, name: str | None = None, **match) -> list[dict]:
        """Structured log events (every run), by ``event`` name and key=value matches."""
        return [ev for ev in log_events(self.log_path)
                if (name is None or ev.get("event") == name) and all(ev.get(k) == v for k, v in match.items())]

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
