"""What chaos clients saw, written down so that an independent checker can judge it.

Every process (each chaos client, and the test driving them) appends JSON lines
to a file of its own, so no two writers share a file and a killed process loses
at most its last, partial line. Each event carries ``time.monotonic_ns()``:
CLOCK_MONOTONIC is one clock for the whole Linux machine, so events of
different processes are ordered by it; wall time is kept for humans.

Events (``ev``) and their fields besides ``t``, ``wall``, ``pid``, ``proc``:

    acquire_req   group, job[, priority]    an Acquire call begins (priority: its class, groups with priorities)
    enqueued      group, job, token         optional: the waiter's key exists
    granted       group, job, token         Acquire returned the grant
    cs_start      group, job, token         the critical section begins
    cs_end        group, job, token         ... and ends
    yield         group, job, token         Yield returned
    error         group, job, message       the attempt failed, explicitly
    abandoned     group, job                written by the test for a client it killed
    fence_ok      group, job, token, ops    FencedResource accepted an operation
    fence_reject  group, job, token, highest   ... refused one with an older token
    data_check    group, job, ok, detail    a client's data survived (or not)

``FencedResource`` stands for the GPU: a file guarded by ``flock`` that keeps the
highest token seen per group and refuses older ones, as the node agent does.
It records its verdict while holding the lock, so the history orders fence
events exactly as the resource did.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import threading
import time


class HistoryRecorder:
    """Appends events to ``<directory>/<name>-<pid>.jsonl``, one flushed line each."""

    def __init__(self, directory: str, name: str = "proc", job: str | None = None):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{name}-{os.getpid()}.jsonl")
        self.name = name
        self.job = job
        self._lock = threading.Lock()  # async tasks and threads of one client share it
        self._file = open(self.path, "a", encoding="utf-8")

    def record(self, ev: str, **fields) -> dict:
        """Append one event; ``job`` defaults to the recorder's job."""
        fields.setdefault("job", self.job)
        event = {"ev": ev, "t": time.monotonic_ns(), "wall": time.time(),
                 "pid": os.getpid(), "proc": self.name, **fields}
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
        return event

    def acquire_req(self, group: str, **kw) -> dict:
        return self.record("acquire_req", group=group, **kw)

    def enqueued(self, group: str, token: int, **kw) -> dict:
        return self.record("enqueued", group=group, token=token, **kw)

    def granted(self, group: str, token: int, **kw) -> dict:
        return self.record("granted", group=group, token=token, **kw)

    def cs_start(self, group: str, token: int, **kw) -> dict:
        return self.record("cs_start", group=group, token=token, **kw)

    def cs_end(self, group: str, token: int, **kw) -> dict:
        return self.record("cs_end", group=group, token=token, **kw)

    def yielded(self, group: str, token: int, **kw) -> dict:
        return self.record("yield", group=group, token=token, **kw)

    def error(self, group: str, message: str, **kw) -> dict:
        return self.record("error", group=group, message=message, **kw)

    def abandoned(self, group: str, job: str, **kw) -> dict:
        return self.record("abandoned", group=group, job=job, **kw)

    def data_check(self, group: str, ok: bool, detail: str = "", **kw) -> dict:
        return self.record("data_check", group=group, ok=ok, detail=detail, **kw)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> HistoryRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_history(directory: str) -> list[dict]:
    """Every ``*.jsonl`` under ``directory``, merged and sorted by monotonic time.

    A line that does not parse is dropped only if it is the last of its file (a
    process killed mid-write); anywhere else it means corruption and raises.
    """
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except ValueError:
                if any(rest.strip() for rest in lines[i + 1:]):
                    raise ValueError(f"{path}:{i + 1}: corrupt history line") from None
    events.sort(key=lambda e: e["t"])
    return events


MiB = 1 << 20


def fence_path(a, group: str) -> str:
    """A client's fenced resource of ``group`` (``a``: its arguments): one for the group, or with
    ``--fit`` one per job (a fit group's holders run side by side by design; there the fence stops a
    stale section of the job itself)."""
    return os.path.join(a.fence_dir, f"fence-{group}-{a.job}.json" if a.fit else f"fence-{group}.json")


class FencedResource:
    """A shared "GPU": operations carry a fencing token; older tokens are refused.

    State (a JSON file): the highest token seen per group and the number of
    accepted operations per (group, job), which lets a client check that none of
    its work was lost. Read and replaced under an exclusive ``flock`` of a lock
    file beside it; the new state is written to a file of its own and renamed
    over the old one, so a client SIGKILLed in the middle of an operation (chaos
    scenarios kill holders) leaves the previous state whole, never an empty file.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock_path = path + ".lock"
        open(self._lock_path, "a").close()

    def _load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.loads(f.read() or "{}")
        except FileNotFoundError:
            return {}

    def _save(self, state: dict) -> None:
        data = json.dumps(state)
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def apply(self, recorder: HistoryRecorder, group: str, token: int,
              job: str | None = None) -> bool:
        """One operation on behalf of ``job``'s grant ``token``: True if accepted."""
        job = job or recorder.job
        with open(self._lock_path, encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            state = self._load()
            highest = state.setdefault("highest", {}).get(group, 0)
            if token < highest:
                recorder.record("fence_reject", group=group, job=job, token=token,
                                highest=highest)
                return False
            state["highest"][group] = token
            ops = state.setdefault("ops", {})
            ops[f"{group}/{job}"] = ops.get(f"{group}/{job}", 0) + 1
            self._save(state)
            recorder.record("fence_ok", group=group, job=job, token=token,
                            ops=ops[f"{group}/{job}"])
            return True

    def ops(self, group: str, job: str) -> int:
        """Accepted operations of ``job`` in ``group`` so far."""
        with open(self._lock_path, encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            state = self._load()
        return state.get("ops", {}).get(f"{group}/{job}", 0)

    def verify(self, recorder: HistoryRecorder, group: str, expected_ops: int,
               job: str | None = None) -> bool:
        """Record a ``data_check``: did the resource keep all ``expected_ops`` of ``job``?"""
        job = job or recorder.job
        actual = self.ops(group, job)
        ok = actual == expected_ops
        recorder.data_check(group, ok, f"expected {expected_ops} ops, resource has {actual}",
                            job=job)
        return ok
