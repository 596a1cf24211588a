"""The ``--json`` convention of every ``timeslice`` subcommand, wherever its module lives.

Command modules of the job library (``timeslice.cli_*``) and of the server side (``timeslice up``,
``demo`` and ``report``, plugged in through the ``timeslice.commands`` entry points) print the
same way: one JSON object on stdout with ``--json``, else the human text.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def to_jsonable(data: Any) -> Any:
    if hasattr(data, "to_dict"):
        return data.to_dict()
    if isinstance(data, (list, tuple)):
        return [to_jsonable(d) for d in data]
    if isinstance(data, dict):
        return {k: to_jsonable(v) for k, v in data.items()}
    return data


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str] | str) -> None:
    """Print ``data`` as JSON with ``--json``, else the human ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(to_jsonable(data), sort_keys=True), flush=True)
    else:
        print(text() if callable(text) else text, flush=True)
