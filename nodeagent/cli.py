"""`nodeagent serve ...`: run the node agent of one GPU node."""
from __future__ import annotations

import asyncio
import sys

from timeslice.common.device_errors import BackendUnavailable
from timeslice.common.errors import ConfigError, TimesliceError
from timeslice.common.server import logs
from timeslice.common.server.serving import serve_config
from timeslice.nodeagent import config as C


def main(argv: list[str] | None = None) -> int:
    cfg = serve_config("nodeagent", "timeslice node agent", "run snapshot/restore intents for this node; serve the "
                       "direct API", C.add_arguments, C.from_args, argv, (TimesliceError,))   # a bad --node too
    if cfg is None:
        return 2
    logs.configure("nodeagent", cfg.log_level, node=cfg.node)
    from timeslice.nodeagent.server import serve
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except (ConfigError, BackendUnavailable) as e:
        print(f"nodeagent: cannot start: {e}", file=sys.stderr)
        return 2
    except (TimesliceError, asyncio.TimeoutError) as e:     # etcd unreachable at start
        print(f"nodeagent: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
