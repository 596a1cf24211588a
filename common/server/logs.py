"""structlog set-up: one JSON object per line, stable keys, for every line a server writes.

Events are snake_case verbs (``grant``, ``swap_started``, ``session_lost``);
context keys are always spelled the same: group, job, token, epoch, op, node,
replica. Tests assert on them, so renaming one is an API change.

* ``configure(component, level, **context)`` binds ``component`` and the
  process's identity (``replica=`` for lockd, ``node=`` for an agent) to every
  event, and routes the standard library's logging (grpc, aetcd, asyncio)
  through the same JSON renderer, with the logger's name in ``logger``.
* Bytes never reach a log line as a Python repr (``b'/timeslice/...'``): bytes
  values are decoded (UTF-8, invalid bytes replaced).
* ``ready(tag, **fields)`` prints the machine-readable "I serve" line as JSON on
  stdout too (``{"event": "lockd_ready", "ready": "LOCKD_READY", "port": ...}``);
  ``parse_ready`` reads it back, and still reads the old ``TAG key=value`` form.
"""
from __future__ import annotations

import json as _json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

_MAX_TEXT = 4096          # a single value is clipped beyond this (bounded log lines)


def _text(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray, memoryview)):
        s = bytes(v).decode("utf-8", "replace")
        return s if len(s) <= _MAX_TEXT else s[:_MAX_TEXT] + "..."
    if isinstance(v, (list, tuple)) and any(isinstance(x, (bytes, bytearray)) for x in v):
        return [_text(x) for x in v]
    return v


def no_bytes(_logger, _name, event: dict) -> dict:
    """Processor: decode bytes values so no ``b'...'`` repr reaches a log line."""
    for k, v in list(event.items()):
        event[k] = _text(v)
    return event


_identity: dict[str, Any] = {}          # component, replica/node: on every event, from any thread


def _add_identity(_logger, _name, event: dict) -> dict:
    for k, v in _identity.items():
        event.setdefault(k, v)
    return event


def _shared() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        _add_identity,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        no_bytes,
        structlog.processors.format_exc_info,
    ]


def configure(component: str, level: str = "info", json: bool = True, stream=None, **context: Any) -> None:
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    stream = stream or sys.stderr
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*_shared(), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    # A processor, not only context variables: threads started without a copy of the
    # context (plain threading.Thread) still name the process's replica or node.
    _identity.clear()
    _identity.update(component=component, **{k: v for k, v in context.items() if v})
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**_identity)
    # The standard library's records (grpc, aetcd, asyncio) through the same renderer.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_shared(), structlog.stdlib.add_logger_name, _stdlib_event],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))   # libraries: their warnings and errors


def _stdlib_event(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A library's message is free text: keep it under ``message``, the event is ``library_log``."""
    event["message"] = str(event.get("event", ""))[:_MAX_TEXT]
    event["event"] = "library_log"
    return event


def ready(tag: str, stream=None, **fields: Any) -> str:
    """Print the machine-readable ready line (JSON) on stdout; returns it."""
    doc = {"event": tag.lower(), "ready": tag, **{k: _text(v) for k, v in fields.items()}}
    for k, v in _identity.items():
        doc.setdefault(k, v)
    line = _json.dumps(doc, sort_keys=True)
    print(line, file=stream or sys.stdout, flush=True)
    return line


def parse_ready(line: bytes | str, tag: str) -> Mapping[str, str] | None:
    """The fields of a ready line for ``tag`` (JSON, or the older ``TAG k=v ...``), else None."""
    text = line.decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else line
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = _json.loads(text)
        except ValueError:
            return None
        if isinstance(doc, dict) and doc.get("ready") == tag:
            return {k: str(v) for k, v in doc.items()}
        return None
    if text.startswith(tag + " "):
        return dict(kv.split("=", 1) for kv in text.split()[1:] if "=" in kv)
    return None
