"""Wakes the Acquire calls blocked on this replica, one job at a time.

Every replica keeps one reflector (one etcd watch) and routes each event to
the waiters it concerns: a grant put wakes only the job it names; a queue or
failure key wakes only its job. A thousand waiters on one group therefore
cost one watch and O(1) work per event, not a thundering herd.
"""
from __future__ import annotations

import asyncio
import json

from timeslice.common.server.etcd.watch import WatchEvent
from timeslice.common.server.keys import Keys


class Waiters:
    def __init__(self, keys: Keys):
        self.keys = keys
        self._w: dict[tuple[str, str], set[asyncio.Event]] = {}

    def register(self, group: str, job: str) -> asyncio.Event:
        ev = asyncio.Event()
        self._w.setdefault((group, job), set()).add(ev)
        return ev

    def unregister(self, group: str, job: str, ev: asyncio.Event) -> None:
        s = self._w.get((group, job))
        if s is not None:
            s.discard(ev)
            if not s:
                del self._w[(group, job)]

    def __len__(self) -> int:
        return sum(len(s) for s in self._w.values())

    def _wake(self, group: str, job: str) -> None:
        for ev in self._w.get((group, job), ()):
            ev.set()

    def on_batch(self, events: list[WatchEvent], reset: bool) -> None:
        if reset:
            for s in self._w.values():
                for waiter in s:
                    waiter.set()
            return
        for ev in events:
            try:
                parts = self.keys.parse(ev.kv.key)
            except ValueError:
                continue
            if parts[0] != "groups" or len(parts) < 3:
                continue
            group, sub = parts[1], parts[2]
            if sub == "grant":
                # Only a grant *put* can end a wait, and it names its job.
                if ev.is_put and ev.kv.value:
                    self._wake(group, json.loads(ev.kv.value).get("job", ""))
            elif sub == "grants" and len(parts) >= 4:
                if ev.is_put:
                    self._wake(group, parts[3])     # a fit group's grant: its key names the job
            elif sub in ("queue", "failures", "moving") and len(parts) >= 4:
                self._wake(group, parts[3])
            elif sub == "spec" and not ev.is_put:
                for (g, j) in list(self._w):
                    if g == group:
                        self._wake(g, j)        # group deleted under its waiters
