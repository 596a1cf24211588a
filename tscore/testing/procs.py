"""Child-process bookkeeping for tests: whatever a test starts, it ends.

Servers that tests start (etcd, lockd, agents, chaos clients) run in their own
session, hence their own process group, so one signal reaches a server and any
children it forked. Every tracked pid is killed by an ``atexit`` hook, so an
interpreter that dies of an exception does not leak processes into the next run.
A process group is signalled only when the process leads it and it is not our
own group: a pid that shares pytest's group is signalled alone.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time

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


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie counts: it has not been reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group if it leads one of its own, else to ``pid``."""
    try:
        if os.getpgid(pid) == pid and pid != os.getpgid(0):
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def terminate(procs, grace: float = 5.0) -> None:
    """SIGTERM (and SIGCONT, so a paused process sees it), then SIGKILL after ``grace`` s.

    ``procs`` is one Popen or pid, or a list of them: all are signalled first and
    then awaited, so ending N processes takes one grace period, not N. A Popen is
    also reaped, so its pid is gone for good when this returns; one that has
    already exited is not signalled, since its pid may belong to someone else now.
    """
    procs = procs if isinstance(procs, list) else [procs]
    live = [p for p in procs if isinstance(p, int) or p.poll() is None]
    for p in live:
        signal_tree(_pid(p), signal.SIGTERM)
        signal_tree(_pid(p), signal.SIGCONT)
    deadline = time.monotonic() + grace
    for p in live:
        if not _wait_gone(p, max(0.0, deadline - time.monotonic())):
            signal_tree(_pid(p), signal.SIGKILL)
            _wait_gone(p, 10.0)
    for p in procs:
        untrack(_pid(p))


def _pid(proc: subprocess.Popen | int) -> int:
    return proc if isinstance(proc, int) else proc.pid


def _wait_gone(proc: subprocess.Popen | int, timeout: float) -> bool:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    while pid_alive(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


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
