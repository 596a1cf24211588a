"""WatchGroup streams, bounded per caller and in total: each open stream holds a reflector listener
and wakes on every batch, so an unbounded number of them (anonymous, the default) slows every handoff.

Sans-IO: ``admit`` counts a stream in and returns a release function, or raises
``LimitExceeded`` naming the limit (RESOURCE_EXHAUSTED; nothing else changes). The
caller is who ``lockd/callers.py`` says (a credential's tenant, a TLS identity, else
the peer's address), so one caller cannot take every place.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from timeslice.common.errors import ConfigError
from timeslice.lockd.errors import LimitExceeded

MAX_WATCHES = 1024
MAX_WATCHES_PER_CALLER = 64


class Watches:
    def __init__(self, total: int = MAX_WATCHES, per_caller: int = MAX_WATCHES_PER_CALLER):
        if total < 1:
            raise ConfigError("--max-watches must be >= 1")
        if not 1 <= per_caller <= total:
            raise ConfigError("--max-watches-per-caller must be in 1..--max-watches")
        self.total, self.per_caller = total, per_caller
        self._open: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(self._open.values())

    def admit(self, caller: str) -> Callable[[], None]:
        """Count a new stream of ``caller`` in; the returned function counts it out (once)."""
        if self._open[caller] >= self.per_caller:
            raise LimitExceeded(f"limit max_watches_per_caller: {caller} has {self._open[caller]} open "
                                f"WatchGroup streams (at most {self.per_caller}); close one first")
        if len(self) >= self.total:
            raise LimitExceeded(f"limit max_watches: {self.total} WatchGroup streams are open on this replica; "
                                "retry later or on another replica")
        self._open[caller] += 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            self._open[caller] -= 1
            if self._open[caller] <= 0:
                del self._open[caller]
        return release
