"""``timeslice``: the command line (console script ``timeslice``, or ``python -m timeslice.cli``).

Subcommands live in modules listed in ``COMMAND_MODULES``. Each module has

    def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None

which adds its parsers (pass ``parents=[common]`` so that ``--target``/``--json``/
``--timeout`` also work after the subcommand) and sets ``func=handler`` on
each; ``handler(args) -> int`` returns the exit status. A module that is not
there (``ModuleNotFoundError`` naming that very module) is skipped, so
``cli_up`` (``timeslice up``) and ``cli_demo`` (``timeslice demo``) plug in by
existing. Helpers for handlers: ``admin_client(args)`` and ``emit(args, data, text)``.

Exit status: 0 ok, 1 an error from lockd or the client (message on stderr),
2 bad usage, 130 interrupted.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import json
import sys
from collections.abc import Callable
from typing import Any

from timeslice.errors import TimesliceClientError
from tscore.defaults import ENV_TARGET

#: Modules that contribute subcommands, in help order. Missing ones are skipped.
COMMAND_MODULES: list[str] = ["timeslice.cli_admin", "timeslice.cli_up", "timeslice.cli_demo"]
CLI_JOB_ID = "timeslice-cli"   # the admin client never opens a session; this id is never used


def _common(suppress: bool) -> argparse.ArgumentParser:
    # The same options on the top-level parser (with defaults) and on every
    # subparser (SUPPRESSed, so they do not overwrite a value given earlier).
    p = argparse.ArgumentParser(add_help=False)
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--target", default=d(None),
                   help="lockd address(es), comma-separated (default: $TIMESLICE_TARGET, else 127.0.0.1:50051)")
    p.add_argument("--json", action="store_true", default=d(False), help="machine-readable JSON output")
    p.add_argument("--timeout", type=float, default=d(15.0), help="deadline of each call, s (default 15)")
    return p


def build_parser(modules: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timeslice", parents=[_common(False)],
                                     description="co-operative GPU time-slicing: groups, holders, queues")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common(True)
    for name in (COMMAND_MODULES if modules is None else modules):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue          # an optional command module that is not installed
            raise
        mod.register(sub, common)
    return parser


@functools.lru_cache(maxsize=1)
def _local_cluster() -> dict | None:
    """The state document of a local cluster started by ``timeslice up`` and still running, or None."""
    try:
        from timeslice.launcher.settings import load
        from timeslice.launcher.state import find_running
        found = find_running(load()[0].log_dir)
    except Exception:                     # no launcher, no readable state: plain default
        return None
    return found[1] if found else None


def default_target() -> str | None:
    """$TIMESLICE_TARGET, else the lockd replicas of a local cluster started by
    ``timeslice up`` and still running (so ``timeslice status`` just works after
    it), else None (the client's own default)."""
    if os.environ.get(ENV_TARGET):
        return None                       # the client reads it itself
    doc = _local_cluster()
    return doc.get("target") if doc else None


def _use_local_admin_token() -> None:
    """Without $TIMESLICE_ADMIN_TOKEN(_FILE), admin calls use the token file of the local cluster."""
    from timeslice.auth import ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE
    if os.environ.get(ENV_ADMIN_TOKEN) or os.environ.get(ENV_ADMIN_TOKEN_FILE):
        return
    doc = _local_cluster()
    if doc and doc.get("admin_token_file"):
        os.environ[ENV_ADMIN_TOKEN_FILE] = doc["admin_token_file"]    # this CLI process only


def admin_client(args: argparse.Namespace):
    """A client for admin/status calls (it opens no session, so needs no job id)."""
    from timeslice.client import OrchestratorClient
    _use_local_admin_token()
    return OrchestratorClient(args.target or default_target(), job_id=CLI_JOB_ID, timeout=args.timeout)


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


def main(argv: list[str] | None = None) -> int:
    # No logging set-up: the library's events go to stdlib logging (warnings on
    # stderr), so stdout carries only the command's output (see timeslice/logs.py).
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except TimesliceClientError as e:
        print(f"timeslice: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
