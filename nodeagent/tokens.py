"""Fencing: the highest token this agent has acted on, per group (docs/ARCHITECTURE.md, invariant 2).

A grant's token is the create revision of the holder's queue key: strictly
increasing per group, durable. Every intent carries the token of the swap it
serves. Once the agent has acted on token t for a group, an intent of that
group with a token below t is a stale order (from a swap that is over) and is
refused; an equal token is the same swap (several jobs are moved for one
grant, and a retried intent is harmless).

The book survives restarts twice over: it is rebuilt from the statuses the
agent wrote in etcd (each carries group and token), and it is kept in a local
file, which still knows a group whose last status has since been overwritten
by another group's op on the same job.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from timeslice.common.files import atomic_write_json
from timeslice.common.server import records as R


class TokenBook:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self._high: dict[str, int] = {}
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._high.update(self._read(self.path))

    def _read(self, path: Path) -> dict[str, int]:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}          # a torn file cannot happen (atomic writes); a bad one is ignored
        return {str(g): int(t) for g, t in doc.get("tokens", {}).items()}

    def highest(self, group: str) -> int:
        return self._high.get(group, 0)

    def stale(self, group: str, token: int) -> str:
        """Why ``token`` must be refused for ``group``, or "" if it may be acted on."""
        high = self.highest(group)
        if token < high:
            return (f"stale_token: intent token {token} of group {group!r} is older than token {high} "
                    "this agent already acted on")
        return ""

    def note(self, group: str, token: int) -> bool:
        """Record that the agent acts on ``token``; persisted before the op starts. True if raised."""
        with self._lock:
            if token <= self._high.get(group, 0):
                return False
            self._high[group] = token
            if self.path is not None:
                atomic_write_json(self.path, {"tokens": dict(self._high)})
            return True

    def recover(self, statuses: list[R.StatusValue]) -> None:
        """Fold in what the agent's own statuses in etcd say it acted on.

        Every status token counts: an op's is the token acted on, a stale-token
        refusal's is the token that fenced it out (see ``intents.status``).
        """
        for st in statuses:
            if st.group and isinstance(st.token, int) and st.token > 0:
                self.note(st.group, st.token)

    def snapshot(self) -> dict[str, int]:
        return dict(self._high)
