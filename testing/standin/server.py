"""SIMULATOR: a stand-in vLLM / SGLang server that releases memory on the simulated device.

vLLM and SGLang cannot be installed where the tests run, so this small HTTP
server implements the documented memory endpoints of both, over real bytes on
the simulated GPU (``timeslice.common.sim``): it is a simulator, never presented as
either server. The endpoints follow:

* vLLM sleep mode, docs for v0.14 (``features/sleep_mode``; the router in
  ``vllm/entrypoints/serve/sleep/api_router.py``, served with
  ``VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode``):
  ``POST /sleep?level=1|2`` (level 1 offloads the weights to host memory and
  discards the KV cache; level 2 discards both), ``POST /wake_up`` with optional
  repeated ``?tags=weights|kv_cache``, ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
* SGLang's native API, ``python/sglang/srt/entrypoints/http_server.py`` as of
  v0.4.9 (served with ``--enable-memory-saver``): ``POST /release_memory_occupation``
  and ``POST /resume_memory_occupation`` with an optional JSON body
  ``{"tags": ["weights", "kv_cache", ...]}`` (none: every region); weights are
  kept in host memory when the server backs them up (``--enable-weights-cpu-backup``),
  here ``--region weights=SIZE:offload``.

Generation, so that a swap can be tested with requests in flight (``server_engine``):
vLLM ``POST /v1/completions`` ``{"prompt", "max_tokens"}``, ``POST /pause?mode=abort|wait|keep``
(``wait_for_inflight_requests=true`` is the older spelling of ``mode=wait``),
``POST /resume``, ``GET /is_paused``; SGLang ``POST /generate``
``{"text", "sampling_params": {"max_new_tokens"}}``, ``POST /pause_generation``
``{"mode": "abort"|"retract"|"in_place"}``, ``POST /continue_generation``. Each token
takes ``--token-ms``. Releasing memory while a request is decoding (or frozen in
place) crashes the stand-in as it does the real servers: the in-flight requests
and every later call answer HTTP 500.

Both flavours also answer ``GET /health``. Sizes are real: each region is a
file of real bytes in the simulated device's directory, its bytes counted in
the device's capacity ledger under the server's pid (so ``SimMeter`` and the
agent see them), a resume that does not fit is refused as the device would
(HTTP 500, the bytes stay in host memory), and an offloaded region comes back
bit-exact (checked with sha256). The server's small "context" lives in its
arena (``arena-<pid>``), so the simulated checkpoint backend can take what is
left after a pause, as the driver would on a GPU.

Test hooks, simulator-only and under ``/sim/``: ``GET /sim/memory`` (regions,
residency, checksums), ``GET /sim/requests`` (in-flight requests by state, counts of
completed, aborted and failed ones, whether the engine crashed), ``POST /sim/fault``
(``{"status": 503, "count": n}`` answers the next n memory or pause calls with that status; ``{"delay_s": x}`` delays
them; ``{"lie": true}`` answers them 200 without doing anything).

    python -m timeslice.testing.standin.server --flavor vllm --port 0 \\
        --region weights=64MiB:offload --region kv_cache=32MiB:discard

It prints one JSON line ``{"event": "ready", "port": ..., "pid": ...}`` on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from http.server import ThreadingHTTPServer

from timeslice.sim.runtime import SimDeviceClient
from timeslice.testing.standin.engine import Engine
from timeslice.testing.standin.memory import Region, ServerMemory, parse_size
from timeslice.testing.standin.routes import SGLANG, VLLM, Faults, Handler


def _region(spec: str, flavor: str) -> tuple[str, int, str]:
    """``name=SIZE[:offload|discard]``; the default policy is the server's own."""
    name, _, rest = spec.partition("=")
    size, _, policy = rest.partition(":")
    if not policy:
        policy = "offload" if name == "weights" else "discard"
    if policy not in ("offload", "discard"):
        raise argparse.ArgumentTypeError(f"region {name}: policy must be offload or discard")
    if flavor == VLLM and name not in ("weights", "kv_cache"):
        raise argparse.ArgumentTypeError("vLLM has two regions: weights and kv_cache")
    return name, parse_size(size), policy


def serve(flavor: str, regions: list[tuple[str, int, str]], host: str = "127.0.0.1", port: int = 0,
          sim_dir: str | None = None, context_bytes: int = 1 << 20, gbps: float = 0.0,
          seed: int = 0, token_s: float = 0.005) -> ThreadingHTTPServer:
    """Allocate the regions on the simulated device and return the (not yet serving) server."""
    dev = SimDeviceClient.open(sim_dir)
    rnd = random.Random(seed)
    mem = ServerMemory(dev, context_bytes, [Region(n, s, p) for n, s, p in regions], rnd, gbps)
    engine = Engine(token_s, mem.step, lambda: not mem.any_released())
    mem.guard = engine.before_release
    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    httpd.mem, httpd.flavor, httpd.faults = mem, flavor, Faults()  # type: ignore[attr-defined]
    httpd.engine = engine  # type: ignore[attr-defined]
    return httpd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SIMULATOR: stand-in vLLM/SGLang memory endpoints "
                                             "over the simulated GPU")
    ap.add_argument("--flavor", choices=(VLLM, SGLANG), required=True)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    ap.add_argument("--port", type=int, default=0, help="port (default: %(default)s = any free port)")
    ap.add_argument("--sim-dir", default=None, help="simulated device directory (default: $TIMESLICE_SIM_DIR)")
    ap.add_argument("--region", action="append", default=[], metavar="NAME=SIZE[:POLICY]",
                    help="a memory region, e.g. weights=64MiB:offload, kv_cache=32MiB:discard")
    ap.add_argument("--context-bytes", type=parse_size, default=1 << 20,
                    help="the server's own context, never released (default: %(default)s)")
    ap.add_argument("--gbps", type=float, default=0.0, help="host<->device copy pacing, 0 = unpaced "
                                                            "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights' contents (default: %(default)s)")
    ap.add_argument("--token-ms", type=float, default=5.0,
                    help="time to decode one token of a generate request, ms (default: %(default)s)")
    a = ap.parse_args(argv)
    specs = a.region or (["weights=8MiB", "kv_cache=4MiB"])
    regions = [_region(s, a.flavor) for s in specs]
    httpd = serve(a.flavor, regions, a.host, a.port, a.sim_dir, a.context_bytes, a.gbps, a.seed,
                  a.token_ms / 1000)
    print(json.dumps({"event": "ready", "simulated": True, "flavor": a.flavor, "pid": os.getpid(),
                      "port": httpd.server_address[1], "device_bytes": httpd.mem.device_bytes()}),  # type: ignore[attr-defined]
          flush=True)
    # SIGTERM exits through the finally below, so the region files are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.mem.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())

