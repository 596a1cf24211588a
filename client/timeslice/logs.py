"""The client's log events: structlog when the application configured it, else stdlib logging.

Events have stable names and keys (``session_opened``, ``acquired``,
``yielded``, ``failover``, ``keepalive_failed``, ``session_lost``,
``job_id_generated``, ... with ``job``, ``group``, ``token``, ``lease``,
``target``), so tests and log pipelines can match on them.

A library must not print into its host's stdout: unconfigured structlog
writes to stdout, so until ``structlog.configure`` has been called the events
go to stdlib logging instead as ``event key=value ...``, one logger per module
(``__name__``, all under ``timeslice``: configuring the ``timeslice`` logger
reaches every one; silent below WARNING unless the application sets up logging).
"""
from __future__ import annotations

import logging
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class EventLog:
    def __init__(self, name: str):
        self.name = name
        self._std = logging.getLogger(name)

    def _emit(self, level: str, event: str, exc_info: bool, kw: dict[str, Any]) -> None:
        if structlog.is_configured():
            logger = structlog.get_logger(self.name)
            if exc_info:
                logger.exception(event, **kw)
            else:
                getattr(logger, level)(event, **kw)
            return
        lvl = _LEVELS[level]
        if self._std.isEnabledFor(lvl):
            fields = " ".join(f"{k}={v!r}" for k, v in kw.items())
            self._std.log(lvl, "%s %s", event, fields, exc_info=exc_info)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit("debug", event, False, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, False, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, False, kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._emit("error", event, True, kw)


def get_logger(name: str) -> EventLog:
    """The log of module ``name`` (pass ``__name__``)."""
    return EventLog(name)
