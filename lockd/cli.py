"""`lockd serve ...`: run one orchestrator replica."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from timeslice.common.errors import ConfigError
from timeslice.common.server import logs
from timeslice.common.version import __version__
from timeslice.lockd import config as C


def _run(coro) -> None:
    # uvloop when installed and not disabled: the replica's CPU goes mostly to the
    # event loop and gRPC's callbacks, which uvloop runs markedly cheaper.
    if os.environ.get("TIMESLICE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lockd", description="timeslice orchestrator replica")
    p.add_argument("--version", action="version", version=f"lockd {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the gRPC API; campaign for leadership")
    C.add_arguments(s)
    a = p.parse_args(argv)
    try:
        cfg = C.from_args(a)
    except (ConfigError, ValueError) as e:
        print(f"lockd: invalid configuration: {e}", file=sys.stderr)
        return 2
    logs.configure("lockd", cfg.log_level, replica=cfg.replica_id)
    from timeslice.lockd.server import serve
    try:
        _run(serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
