"""One agent per node: an exclusive ``flock`` on a file in the agent's state dir.

Two agents acting on one node's intents at once would race on the same
processes (both locking, both checkpointing). The kernel releases a flock
when its holder dies, however it dies, so a restarted agent takes over the
moment the old one is gone, while a *paused* old agent (SIGSTOP, a frozen
container) keeps the node until it is really dead. Two agents only share the
lock if they share the state dir, i.e. run on the same host with the same
--state-dir (on Kubernetes: a hostPath), which is the case that matters.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class NodeLock:
    def __init__(self, state_dir: str | os.PathLike, node: str):
        self.path = Path(state_dir) / f"agent-{node}.lock"
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip()
        except OSError:
            return "?"

    async def acquire(self, poll: float = 0.1) -> None:
        """Wait until no other agent of this node is alive."""
        if self.try_acquire():
            return
        log.warning("node_lock_wait", path=str(self.path), holder_pid=self.holder())
        while not self.try_acquire():
            await asyncio.sleep(poll)
        log.info("node_lock_acquired", path=str(self.path))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
