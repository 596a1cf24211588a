"""Child-process bookkeeping for tests: whatever a test starts, it ends.

Servers that tests start (etcd, lockd, agents, chaos clients) run in their own
session, hence their own process group, so one signal reaches a server and any
children it forked (the launcher's ``pids`` does the signalling). On top of
that, every tracked pid is killed by an ``atexit`` hook, so an interpreter that
dies of an exception does not leak processes into the next run: the product's
launcher must not do that (a detached cluster outlives it), a test must.
"""
from __future__ import annotations

import atexit
import signal
import subprocess
import threading
import time

from timeslice.common import procfs
from timeslice.launcher import pids
from timeslice.launcher.pids import pid_alive, signal_tree

__all__ = ["ProcReaper", "pid_alive", "signal_tree", "terminate", "track", "untrack", "wait_stopped"]

_tracked: dict[int, subprocess.Popen | None] = {}  # pid -> Popen when we are its parent
_lock = threading.Lock()


def track(proc: subprocess.Popen | int) -> None:
    """Remember a child (Popen) or a foreign pid so that it is killed at exit."""
    with _lock:
        if isinstance(proc, int):
            _tracked.setdefault(proc, None)
        else:
            _tracked[proc.pid] = proc


def untrack(pid: int) -> None:
    with _lock:
        _tracked.pop(pid, None)


def terminate(procs, grace: float = 5.0) -> None:
    """``pids.terminate`` (SIGTERM to each group, SIGKILL after ``grace``), then forget them."""
    procs = procs if isinstance(procs, list) else [procs]
    pids.terminate(procs, grace)
    for p in procs:
        untrack(p if isinstance(p, int) else p.pid)


def wait_stopped(pid: int, timeout: float = 5.0) -> bool:
    """Block until every thread of ``pid`` is stopped (state T in /proc): kill(SIGSTOP) returns once
    the signal is queued, and on a loaded machine a thread that is mid-request when it is sent can
    still answer that request (a paused etcd member said "healthy" to a probe sent after the pause).
    False if not all stopped within ``timeout`` (or it is gone): the caller's pause is then best effort."""
    deadline = time.monotonic() + timeout
    while True:
        states = procfs.thread_states(pid)
        if states is None:
            return False
        if states and all(s in ("T", "t") for s in states):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


@atexit.register
def _kill_leftovers() -> None:
    with _lock:
        leftovers = list(_tracked.items())
    for pid, proc in leftovers:
        if proc is None or proc.poll() is None:
            signal_tree(pid, signal.SIGKILL)
            if proc is not None:
                proc.wait()
        untrack(pid)


class ProcReaper:
    """Processes one test owns; ``reap()`` ends them all, whatever the test's outcome."""

    def __init__(self, grace: float = 2.0):
        self.grace = grace
        self._procs: list[subprocess.Popen | int] = []

    def spawn(self, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` in its own process group and register it."""
        proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
        return self.register(proc)

    def register(self, proc: subprocess.Popen | int):
        """Register a Popen or a pid started elsewhere; returns it unchanged."""
        track(proc)
        self._procs.append(proc)
        return proc

    def reap(self) -> None:
        """Terminate every registered process that is still there (idempotent)."""
        procs, self._procs = self._procs, []
        terminate(procs, self.grace)
