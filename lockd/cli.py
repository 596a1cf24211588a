"""`lockd serve ...`: run one orchestrator replica."""
from __future__ import annotations

import asyncio
import os
import sys

from timeslice.common.errors import ConfigError
from timeslice.common.server import logs
from timeslice.common.server.serving import serve_config
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
    cfg = serve_config("lockd", "timeslice orchestrator replica", "serve the gRPC API; campaign for leadership",
                       C.add_arguments, C.from_args, argv, (ConfigError, ValueError))
    if cfg is None:
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
