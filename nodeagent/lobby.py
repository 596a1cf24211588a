"""The channel's lobby: connections that have not proven a job yet, bounded per process, per user and in total.

The node-local socket is open to every local process (mode 0666: a job's
process may run as any user), so what a connection costs before its hello is
checked must be bounded, or a few processes holding silent connections
exhaust the agent's file descriptors, the listen backlog fills, and a real
worker's ``connect()`` fails. The lobby never refuses a newcomer: the agent
accepts every connection at once (keeping the backlog drained) and, when a
bound is reached, evicts the oldest waiting connection of whoever holds the
most. A worker says hello as soon as it connects, so its one waiting
connection is never the one evicted while a flooder holds many.

Bounds, each checked against the newcomer's own process and user:

* ``per_pid`` waiting connections of one process (a worker needs one);
* ``per_uid`` of one user (the kernel's ``SO_PEERCRED``: a flooder cannot lie);
  the victim is the oldest of that user's busiest process;
* ``total`` of everyone; the victim is taken from the busiest user.

Sans-IO: ``enter`` says whom to evict; the channel server closes them.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

PER_PID = 8
PER_UID = 64
TOTAL = 256


@dataclass(eq=False)
class Seat:
    """One waiting connection. ``evicted`` is set when the lobby gave its place to a newcomer."""

    pid: int
    uid: int
    seq: int
    handle: object = None                 # what the server needs to close it (its writer)
    evicted: bool = False
    why: str = field(default="", repr=False)


class Lobby:
    def __init__(self, per_pid: int = PER_PID, per_uid: int = PER_UID, total: int = TOTAL):
        if not 0 < per_pid <= per_uid <= total:
            raise ValueError(f"lobby bounds must satisfy 0 < per_pid <= per_uid <= total, got "
                             f"{per_pid}, {per_uid}, {total}")
        self.per_pid, self.per_uid, self.total = per_pid, per_uid, total
        self._seats: dict[int, Seat] = {}                  # seq -> seat, oldest first (insertion order)
        self._pids: Counter[int] = Counter()
        self._uids: Counter[int] = Counter()
        self._seq = itertools.count()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._seats)

    def seats(self) -> list[Seat]:
        """Every waiting connection, oldest first (a copy: the caller may make them leave)."""
        return list(self._seats.values())

    def waiting(self, uid: int | None = None, pid: int | None = None) -> int:
        if pid is not None:
            return self._pids[pid]
        return self._uids[uid] if uid is not None else len(self._seats)

    def enter(self, pid: int, uid: int, handle: object = None) -> tuple[Seat, list[Seat]]:
        """Seat a newcomer; returns its seat and the seats evicted to make room (already left)."""
        out: list[Seat] = []
        victim = self._victim(pid, uid)
        if victim is not None:
            self._leave(victim)
            victim.evicted = True
            self.evictions += 1
            out.append(victim)
        seat = Seat(pid, uid, next(self._seq), handle)
        self._seats[seat.seq] = seat
        self._pids[pid] += 1
        self._uids[uid] += 1
        return seat, out

    def leave(self, seat: Seat) -> None:
        """The connection said hello (or closed): it no longer waits. Idempotent."""
        if self._seats.get(seat.seq) is seat:
            self._leave(seat)

    def _leave(self, seat: Seat) -> None:
        del self._seats[seat.seq]
        for counter, k in ((self._pids, seat.pid), (self._uids, seat.uid)):
            counter[k] -= 1
            if counter[k] <= 0:
                del counter[k]

    def _victim(self, pid: int, uid: int) -> Seat | None:
        if self._pids[pid] >= self.per_pid:
            return self._oldest(lambda s: s.pid == pid,
                                f"more than {self.per_pid} connections of pid {pid} wait for a hello")
        if self._uids[uid] >= self.per_uid:
            return self._busiest(lambda s: s.uid == uid,
                                 f"more than {self.per_uid} connections of uid {uid} wait for a hello")
        if len(self._seats) >= self.total:
            top = max(self._uids.values())
            busiest = {u for u, n in self._uids.items() if n == top}
            return self._busiest(lambda s: s.uid in busiest,
                                 f"more than {self.total} connections wait for a hello")
        return None

    def _busiest(self, among: Callable[[Seat], bool], why: str) -> Seat | None:
        """The oldest waiting connection of the process, among ``among``, that holds the most."""
        counts = Counter(s.pid for s in self._seats.values() if among(s))
        if not counts:
            return None
        top = max(counts.values())
        return self._oldest(lambda s: among(s) and counts[s.pid] == top, why)

    def _oldest(self, pred: Callable[[Seat], bool], why: str) -> Seat | None:
        for s in self._seats.values():
            if pred(s):
                s.why = why
                return s
        return None
