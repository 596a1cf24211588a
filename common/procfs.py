"""What /proc says about a process: is it alive, and which incarnation is it.

A pid alone is not an identity: pids are reused. Everything the agent records
about a process (a snapshot's size, a registration) carries the process's
start time (field 22 of ``/proc/<pid>/stat``, in clock ticks since boot), and a
record whose start time no longer matches belongs to a process that is gone.

``proc_root`` is a parameter everywhere so that tests can point it at fixtures.
"""
from __future__ import annotations

import os
from pathlib import Path

PROC_ROOT = "/proc"


def _stat_fields(pid: int, proc_root: str | os.PathLike) -> list[str] | None:
    try:
        text = (Path(proc_root) / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except PermissionError:
        return None
    # The command name (field 2) is in parentheses and may itself contain
    # spaces or ')'; everything after the *last* ')' splits cleanly.
    close = text.rfind(")")
    if close < 0:
        return None
    return [text[: text.find("(")].strip(), text[text.find("(") + 1: close], *text[close + 2:].split()]


def start_time(pid: int, proc_root: str | os.PathLike = PROC_ROOT) -> int | None:
    """The process's start time in clock ticks, or None if it is gone or a zombie.

    A zombie has exited: its memory and its CUDA context are already freed,
    only its parent has not reaped it yet. For us it is gone.
    """
    if pid <= 0:
        return None
    f = _stat_fields(pid, proc_root)
    if f is None or len(f) < 22:
        return None
    if f[2] in ("Z", "X", "x"):
        return None
    return int(f[21])


def parent_pid(pid: int, proc_root: str | os.PathLike = PROC_ROOT) -> int | None:
    """The parent's pid (``stat`` field 4), or None if the process is gone."""
    f = _stat_fields(pid, proc_root)
    return int(f[3]) if f is not None and len(f) > 3 else None


def is_alive(pid: int, proc_root: str | os.PathLike = PROC_ROOT) -> bool:
    return start_time(pid, proc_root) is not None


def thread_states(pid: int, proc_root: str | os.PathLike = PROC_ROOT) -> list[str] | None:
    """The state letter (``R``, ``S``, ``T``, ...) of each thread of ``pid``, or None if it is gone."""
    try:
        tids = os.listdir(Path(proc_root) / str(pid) / "task")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        return None
    fields = (_stat_fields(int(t), Path(proc_root) / str(pid) / "task") for t in tids)
    return [f[2] for f in fields if f is not None]         # a thread that exited meanwhile is left out


def same_process(pid: int, recorded_start: int | None, proc_root: str | os.PathLike = PROC_ROOT) -> bool:
    """True if ``pid`` is alive and (when a start time was recorded) is the same incarnation."""
    now = start_time(pid, proc_root)
    if now is None:
        return False
    return recorded_start is None or recorded_start == now
