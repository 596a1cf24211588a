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
    _send(pid, sig, _leads_group(pid))


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid != os.getpgid(0)
    except ProcessLookupError:
        return False


def _send(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def terminate(procs, grace: float = 5.0) -> None:
    """SIGTERM (and SIGCONT, so a paused process sees it), then SIGKILL after ``grace`` s.

    ``procs`` is one Popen or pid, or a list of them: all are signalled first and
    then awaited, so ending N processes takes one grace period, not N. A process
    that leads its own group is done only when the whole group has exited. A
    Popen is also reaped. Of a Popen that had already exited only the group it
    left behind is signalled: its pid may belong to someone else by now.
    """
    procs = procs if isinstance(procs, list) else [procs]
    live, groups = [], set()
    for p in procs:
        pid = _pid(p)
        if isinstance(p, int) or p.poll() is None:
            live.append(p)
            if _leads_group(pid):
                groups.add(pid)
        elif _group_running(pid):
            # It exited, but children it left in its group live on. The group id
            # is still that group's: Linux does not reuse it while members live.
            live.append(p)
            groups.add(pid)
    for p in live:
        _send(_pid(p), signal.SIGTERM, _pid(p) in groups)
        _send(_pid(p), signal.SIGCONT, _pid(p) in groups)
    deadline = time.monotonic() + grace
    for p in live:
        pid = _pid(p)
        done = _wait_gone(p, deadline)
        if done and pid in groups:
            done = _wait_until(lambda: not _group_running(pid), deadline)
        if not done:
            _send(pid, signal.SIGKILL, pid in groups)
            _wait_gone(p, time.monotonic() + 10.0)
    for p in procs:
        untrack(_pid(p))


def _pid(proc: subprocess.Popen | int) -> int:
    return proc if isinstance(proc, int) else proc.pid


def _wait_gone(proc: subprocess.Popen | int, deadline: float) -> bool:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False
    return _wait_until(lambda: not _running(proc), deadline)


def _wait_until(cond, deadline: float) -> bool:
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[2])


def _running(pid: int) -> bool:
    """Alive and not a zombie: a zombie has exited, only its parent has not reaped it."""
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"


def _group_running(pgid: int) -> bool:
    """Whether any non-zombie process is still in group ``pgid``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == pgid and st[0] not in "ZX":
                return True
    return False


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
