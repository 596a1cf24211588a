"""`lockd serve ...`: run one orchestrator replica."""
from __future__ import annotations

import argparse
import asyncio
import sys

from lockd import config as C
from tscore import logs
from tscore.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lockd", description="timeslice orchestrator replica")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the gRPC API; campaign for leadership")
    C.add_arguments(s)
    a = p.parse_args(argv)
    try:
        cfg = C.from_args(a)
    except (ConfigError, ValueError) as e:
        print(f"lockd: invalid configuration: {e}", file=sys.stderr)
        return 2
    logs.configure("lockd", cfg.log_level)
    from lockd.server import serve
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
