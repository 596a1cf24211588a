"""structlog set-up: one JSON object per line, stable keys.

Events are snake_case verbs (``grant``, ``swap_started``, ``session_lost``);
context keys are always spelled the same: group, job, token, epoch, op, node,
replica. Tests assert on them, so renaming one is an API change.
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure(component: str, level: str = "info", json: bool = True, stream=None) -> None:
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=processors + [renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
