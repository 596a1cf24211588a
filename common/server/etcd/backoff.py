"""Jittered exponential backoff for loops that run for the life of a process.

Watches, the mirror, sessions and the leader's campaign reconnect forever;
what they need from a retry library is only the *wait*: tenacity's
``wait_random_exponential`` (exponential growth, full jitter, so that the
replicas and agents of a cluster do not reconnect to a restarted etcd member
in lockstep). ``Backoff`` drives that strategy with a failure count that
resets on success: a watch that ran for an hour and then broke starts again
from the shortest wait.
"""
from __future__ import annotations

import tenacity


class Backoff:
    def __init__(self, initial: float = 0.05, maximum: float = 2.0):
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial, self.maximum = initial, maximum
        self._wait = tenacity.wait_random_exponential(multiplier=initial, max=maximum)
        # tenacity's wait strategies read only attempt_number from the state
        self._state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        self.failures = 0

    def reset(self) -> None:
        """The guarded operation made progress: the next failure waits the shortest time again."""
        self.failures = 0

    def next(self) -> float:
        """Seconds to wait after one more failure (uniform in [0, min(initial * 2^n, maximum)])."""
        self.failures += 1
        self._state.attempt_number = self.failures
        return float(self._wait(self._state))
