"""``timeslice``: the command line (console script ``timeslice``, or ``python -m timeslice.cli``).

Subcommands live in modules listed in ``COMMAND_MODULES``. Each module has

    def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None

which adds its parsers (pass ``parents=[common]`` so that ``--target``/``--json``/
``--timeout`` also work after the subcommand) and sets ``func=handler`` on
each; ``handler(args) -> int`` returns the exit status. A module that is not
there (``ModuleNotFoundError`` naming that very module) is skipped, so
``timeslice up`` and ``timeslice demo`` plug in from the local launcher
(``timeslice.launcher.cli_up``, ``timeslice.launcher.cli_demo``, ``timeslice.lockd.report.cli``,
server-side, registered as ``timeslice.commands`` entry points: imported only when the parser
is built, and they say so when the ``server`` extra is missing). Helpers for handlers:
``admin_client(args)`` here and ``emit(args, data, text)`` in ``timeslice.common.cliout``.

Exit status: 0 ok, 1 an error from lockd or the client (message on stderr),
2 bad usage, 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import socket
import sys

from timeslice.common.defaults import ENV_TARGET
from timeslice.common.local import running_cluster
from timeslice.common.version import __version__
from timeslice.errors import TimesliceClientError

#: The job library's own modules that contribute subcommands, in help order. The server side's
#: (``up``, ``demo``, ``report``) plug in through the ``timeslice.commands`` entry points
#: (pyproject.toml), so this module names none of them and imports nothing server-side.
COMMAND_MODULES: list[str] = ["timeslice.cli_admin", "timeslice.cli_advise", "timeslice.cli_slurm"]
ENTRY_POINTS = "timeslice.commands"
CLI_JOB_ID = "timeslice-cli"   # the admin client never opens a session; this id is never used


def _common(suppress: bool) -> argparse.ArgumentParser:
    # The same options on the top-level parser (with defaults) and on every
    # subparser (SUPPRESSed, so they do not overwrite a value given earlier).
    p = argparse.ArgumentParser(add_help=False)
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--target", default=d(None),
                   help="lockd address(es), comma-separated (default: $TIMESLICE_TARGET, else 127.0.0.1:50051)")
    p.add_argument("--json", action="store_true", default=d(False), help="machine-readable JSON output")
    p.add_argument("--timeout", type=float, default=d(15.0), help="deadline of each call, s (default: 15)")
    return p


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's default in its help line, unless it says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text.lower() or d is None or d is False
                or d is argparse.SUPPRESS or d == [] or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)"


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _all_parsers(child)


def build_parser(modules: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timeslice", parents=[_common(False)],
                                     description="co-operative GPU time-slicing: groups, holders, queues")
    parser.add_argument("--version", action="version", version=f"timeslice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common(True)
    for name in (COMMAND_MODULES + plugin_modules() if modules is None else modules):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue          # an optional command module that is not installed
            raise
        mod.register(sub, common)
    for p in _all_parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def plugin_modules() -> list[str]:
    """The command modules other parts of the namespace register (entry points), by command name."""
    found = sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda ep: ep.name)
    return [ep.value for ep in found]


def default_target() -> str | None:
    """$TIMESLICE_TARGET, else the lockd replicas of a local cluster started by
    ``timeslice up`` and still running (so ``timeslice status`` just works after
    it), else None (the client's own default)."""
    if os.environ.get(ENV_TARGET):
        return None                       # the client reads it itself
    found = running_local_cluster()
    return found[1].get("target") if found else None


def _use_local_admin_token() -> None:
    """Without $TIMESLICE_ADMIN_TOKEN(_FILE), admin calls use the token file of the local cluster."""
    from timeslice.auth import ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE
    if os.environ.get(ENV_ADMIN_TOKEN) or os.environ.get(ENV_ADMIN_TOKEN_FILE):
        return
    found = running_local_cluster()
    doc = found[1] if found else None
    if doc and doc.get("admin_token_file"):
        os.environ[ENV_ADMIN_TOKEN_FILE] = doc["admin_token_file"]    # this CLI process only


def running_local_cluster():
    """(state file, document) of a running ``timeslice up`` cluster, found from any directory
    through the per-user pointers (``timeslice.common.local``, as the job library finds it), or None."""
    return running_cluster()


def admin_client(args: argparse.Namespace):
    """A client for admin/status calls (it opens no session, so needs no job id).

    Fails at once, naming the address, when every lockd target refuses the
    connection: nothing listens there, so retrying for the whole --timeout
    (as the library does for a replica that is failing over) only delays the answer.
    """
    from timeslice.client import OrchestratorClient
    _use_local_admin_token()
    target = args.target or default_target()
    fail_fast_if_refused(target)
    return OrchestratorClient(target, job_id=CLI_JOB_ID, timeout=args.timeout)


def fail_fast_if_refused(target: str | None, probe_timeout: float = 1.0) -> None:
    """Raise ``UnavailableError`` naming the targets if each one refuses a TCP connection."""
    from timeslice.config import parse_targets
    from timeslice.errors import UnavailableError
    targets = parse_targets(target or os.environ.get(ENV_TARGET) or None)
    refused = []
    for t in targets:
        host, _, port = t.rpartition(":")
        if not port.isdigit() or "://" in t or t.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
            return                            # not a plain host:port: let the client deal with it
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=probe_timeout).close()
            return                            # one answers: use the client as usual
        except ConnectionRefusedError:
            refused.append(t)
        except OSError:
            return                            # unreachable or slow, not refused: the client retries
    raise UnavailableError(
        f"cannot reach lockd at {', '.join(refused)} (connection refused); start a local cluster with "
        f"`timeslice up --detach`, or point --target / ${ENV_TARGET} at a running lockd")


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
