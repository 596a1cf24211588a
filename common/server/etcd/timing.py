"""Timing settings, validated at construction (as client-go's leader election does).

A lock is only as safe as its timeouts are consistent: a leader must stop
acting before its lease can expire, and keepalives must come often enough to
survive a lost one or two.
"""
from __future__ import annotations

from dataclasses import dataclass

from timeslice.common.errors import ConfigError


@dataclass(frozen=True)
class SessionTiming:
    """A session's lease.

    ttl: lease time-to-live, seconds (default 10: a dead client's waiters move
        on within 10 s; etcd's own minimum TTL is about 5 s on 3.4/3.5 with
        default heartbeat, shorter values are rounded up by the server).
    keepalive_interval: seconds between keepalives; default ttl/3, so two may
        be lost before the lease is at risk.
    """

    ttl: int = 10
    keepalive_interval: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ttl, int) or self.ttl < 2:
            raise ConfigError(f"session ttl must be an integer >= 2 s, got {self.ttl!r}")
        if self.keepalive_interval is None:
            object.__setattr__(self, "keepalive_interval", self.ttl / 3)
        if not 0 < self.interval <= self.ttl / 2:
            raise ConfigError(
                f"keepalive interval {self.keepalive_interval} must be in (0, ttl/2 = {self.ttl / 2}]"
            )

    @property
    def interval(self) -> float:
        """The keepalive interval, resolved (ttl/3 unless given)."""
        assert self.keepalive_interval is not None      # set by __post_init__
        return self.keepalive_interval


@dataclass(frozen=True)
class ElectionTiming:
    """Leader election timing (names and rule from client-go).

    lease_ttl: the leader's session TTL; a dead leader is replaced after it.
    renew_deadline: a leader that could not renew its lease for this long
        steps down on its own, before the lease can expire under it.
    retry_period: keepalive interval, and the pause between campaigns.
    Rule: lease_ttl > renew_deadline > 1.2 * retry_period.
    """

    lease_ttl: int = 3
    renew_deadline: float = 2.0
    retry_period: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.lease_ttl, int) or self.lease_ttl < 2:
            raise ConfigError(f"election lease ttl must be an integer >= 2 s, got {self.lease_ttl!r}")
        if not self.lease_ttl > self.renew_deadline:
            raise ConfigError(
                f"lease ttl ({self.lease_ttl}) must be greater than renew deadline ({self.renew_deadline})"
            )
        if not self.renew_deadline > 1.2 * self.retry_period:
            raise ConfigError(
                f"renew deadline ({self.renew_deadline}) must be greater than 1.2 x retry period "
                f"({self.retry_period})"
            )
        if self.retry_period <= 0:
            raise ConfigError("retry period must be > 0")

    def session(self) -> SessionTiming:
        return SessionTiming(ttl=self.lease_ttl, keepalive_interval=self.retry_period)
