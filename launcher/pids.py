"""What the launcher knows about a pid: is it (still) ours, signal it and its group, end it.

Every server the launcher starts leads a process group of its own
(``start_new_session``), so one signal reaches the server and whatever it
forked. A group is signalled only when the pid leads it and it is not the
caller's own group: a pid that shares our group is signalled alone.

A process is identified by pid *and* start time, so a stop issued later
(``timeslice up --stop``, from another process) never signals a process that
merely reuses the pid. The facts come from ``/proc/<pid>/stat`` (Linux only,
as the whole launcher is); psutil would read the same file.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
        return None


def state(pid: int) -> str | None:
    """The process state letter (R, S, T = stopped, Z = zombie, ...), or None if it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks (field 22 of stat(5)); None if gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])


def same_process(pid: int, started: int | None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or started == now)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie counts: it has not been reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int) -> bool:
    """Alive and not a zombie: a zombie has exited, only its parent has not reaped it."""
    st = state(pid)
    return st is not None and st not in ("Z", "X", "x")


def group_running(pgid: int) -> bool:
    """Whether any non-zombie process is still in group ``pgid``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X", "x"):
                return True
    return False


def leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid != os.getpgid(0)
    except ProcessLookupError:
        return False


def send(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group if it leads one of its own, else to ``pid``."""
    send(pid, sig, leads_group(pid))


Proc = subprocess.Popen | int


def terminate(procs: Proc | list[Proc], grace: float = 5.0) -> None:
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
            if leads_group(pid):
                groups.add(pid)
        elif group_running(pid):
            # It exited, but children it left in its group live on. The group id
            # is still that group's: Linux does not reuse it while members live.
            live.append(p)
            groups.add(pid)
    for p in live:
        send(_pid(p), signal.SIGTERM, _pid(p) in groups)
        send(_pid(p), signal.SIGCONT, _pid(p) in groups)
    deadline = time.monotonic() + grace
    for p in live:
        pid = _pid(p)
        done = _wait_gone(p, deadline)
        if done and pid in groups:
            done = wait_until(functools.partial(_group_gone, pid), deadline)
        if not done:
            send(pid, signal.SIGKILL, pid in groups)
            _wait_gone(p, time.monotonic() + 10.0)


def _group_gone(pgid: int) -> bool:
    return not group_running(pgid)


def _pid(proc: Proc) -> int:
    return proc if isinstance(proc, int) else proc.pid


def _wait_gone(proc: Proc, deadline: float) -> bool:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False
    return wait_until(lambda: not running(proc), deadline)


def wait_until(cond: Callable[[], bool], deadline: float, step: float = 0.02) -> bool:
    """Poll ``cond`` until it holds (True) or ``deadline`` (monotonic) passes (False)."""
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True
