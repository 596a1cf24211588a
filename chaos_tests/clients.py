"""The chaos scenario's client processes, as their history files show them.

``ClientsView`` is the part of ``scenario.World`` that reads the clients'
histories (who holds, who waits, what attempt a client left open) and acts on
one client (kill, pause, resume). It expects the world's ``clients``,
``history_dir``, ``rng``, ``rec`` (the test's history writer) and ``_mu``.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from chaos_tests.history import HistoryRecorder
from timeslice.testing.procs import signal_tree

#: The events that mark where a client is in its turn.
_TURN = ("acquire_req", "granted", "cs_start", "cs_end", "yield", "error")


@dataclass
class ClientProc:
    job: str
    proc: subprocess.Popen
    log_path: str
    killed: bool = False
    crashed: int | None = None        # exit status of a client that died on its own (not rc 0)
    paused_at: list[float] = field(default_factory=list)
    kind: object = None               # the world's ClientKind it was made from (scenario.py)

    @property
    def pid(self) -> int:
        return self.proc.pid


class ClientsView:
    clients: list[ClientProc]
    history_dir: str
    rng: random.Random
    rec: HistoryRecorder
    _mu: threading.Lock

    def last_event(self, c: ClientProc) -> dict | None:
        """The newest event of a client's history (its file is ``client-<job>-<pid>.jsonl``)."""
        path = os.path.join(self.history_dir, f"client-{c.job}-{c.pid}.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = [ln for ln in f.read().split(b"\n") if ln.strip()]
        except FileNotFoundError:
            return None
        for ln in reversed(lines):
            try:
                return json.loads(ln)
            except ValueError:
                continue
        return None

    def last_of(self, c: ClientProc, evs: tuple[str, ...]) -> dict | None:
        """The newest event of one of these kinds in the tail of a client's history."""
        path = os.path.join(self.history_dir, f"client-{c.job}-{c.pid}.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                start = max(0, f.tell() - 16384)
                f.seek(start)
                lines = f.read().split(b"\n")[1 if start else 0:]
        except FileNotFoundError:
            return None
        for ln in reversed(lines):
            try:
                e = json.loads(ln)
            except ValueError:
                continue
            if e.get("ev") in evs:
                return e
        return None

    def live_clients(self) -> list[ClientProc]:
        return [c for c in self.clients if not c.killed and c.proc.poll() is None]

    def holders(self) -> list[ClientProc]:
        """Clients inside a critical section right now (as their histories say)."""
        # A section's own reports (memory, data_check, ...) may follow its cs_start; its closing
        # fenced operation (fence_ok / fence_reject) means it is on its way out.
        return [c for c in self.live_clients()
                if (e := self.last_of(c, (*_TURN, "fence_ok", "fence_reject"))) and e["ev"] == "cs_start"]

    def wait_for_holder(self, timeout: float = 10.0) -> ClientProc:
        """A client inside its critical section (seeded choice among those seen there)."""
        deadline = time.monotonic() + timeout
        while True:
            inside = self.holders()
            if inside:
                return self.rng.choice(sorted(inside, key=lambda c: c.job))
            if time.monotonic() > deadline:
                raise TimeoutError("no client entered a critical section")
            time.sleep(0.002)

    def wait_for_waiter(self, timeout: float = 10.0) -> tuple[ClientProc, dict]:
        """A client blocked in an acquire right now, and its ``acquire_req`` event (seeded choice)."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = [(c, e) for c in self.live_clients() if (e := self.last_of(c, _TURN)) and e["ev"] == "acquire_req"]
            if waiting:
                return self.rng.choice(sorted(waiting, key=lambda x: x[0].job))
            if time.monotonic() > deadline:
                raise TimeoutError("no client was waiting in an acquire")
            time.sleep(0.002)

    def client_events(self, c: ClientProc) -> list[dict]:
        return load_history_file(os.path.join(self.history_dir, f"client-{c.job}-{c.pid}.jsonl"))

    def kill_client(self, c: ClientProc) -> dict:
        """SIGKILL a client and record ``abandoned`` for the attempt or hold it left open."""
        with self._mu:
            if c.crashed is not None:
                return {"job": c.job, "pid": c.pid, "group": None}
            c.killed = True
            signal_tree(c.pid, signal.SIGKILL)
            c.proc.wait(10)
            open_group = self._open_group(c)
            if open_group:
                self.rec.abandoned(open_group, c.job)
        return {"job": c.job, "pid": c.pid, "group": open_group}

    def _open_group(self, c: ClientProc) -> str | None:
        """The group of the client's last attempt if it did not end (yield or error)."""
        path = os.path.join(self.history_dir, f"client-{c.job}-{c.pid}.jsonl")
        group = None
        for e in load_history_file(path):
            if e["ev"] == "acquire_req":
                group = e["group"]
            elif e["ev"] in ("yield", "error"):
                group = None
        return group

    def pause_client(self, c: ClientProc) -> None:
        signal_tree(c.pid, signal.SIGSTOP)
        c.paused_at.append(time.monotonic())

    def resume_client(self, c: ClientProc) -> None:
        signal_tree(c.pid, signal.SIGCONT)


def load_history_file(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out
