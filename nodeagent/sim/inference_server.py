"""SIMULATOR: a stand-in vLLM / SGLang server that releases memory on the simulated device.

vLLM and SGLang cannot be installed where the tests run, so this small HTTP
server implements the documented memory endpoints of both, over real bytes on
the simulated GPU (``nodeagent.sim``): it is a simulator, never presented as
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

Both flavours also answer ``GET /health``. Sizes are real: each region is a
file of real bytes in the simulated device's directory, its bytes counted in
the device's capacity ledger under the server's pid (so ``SimMeter`` and the
agent see them), a resume that does not fit is refused as the device would
(HTTP 500, the bytes stay in host memory), and an offloaded region comes back
bit-exact (checked with sha256). The server's small "context" lives in its
arena (``arena-<pid>``), so the simulated checkpoint backend can take what is
left after a pause, as the driver would on a GPU.

Test hooks, simulator-only and under ``/sim/``: ``GET /sim/memory`` (regions,
residency, checksums), ``POST /sim/fault`` (``{"status": 503, "count": n}``
answers the next n memory calls with that status; ``{"delay_s": x}`` delays
them; ``{"lie": true}`` answers them 200 without doing anything).

    python -m timeslice.nodeagent.sim.inference_server --flavor vllm --port 0 \\
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
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from timeslice.nodeagent.backends.errors import DeviceOutOfMemory
from timeslice.nodeagent.sim.client import SimDeviceClient
from timeslice.nodeagent.sim.server_memory import Region, ServerMemory, parse_size

VLLM, SGLANG = "vllm", "sglang"
MAX_BODY = 16 << 10  # request bodies are tiny JSON; bound what is read


class Faults:
    """Injected misbehaviour (simulator test hooks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status = 0
        self.count = 0
        self.delay_s = 0.0
        self.lie = False

    def take(self) -> tuple[int, float, bool]:
        with self.lock:
            status = 0
            if self.count > 0:
                self.count -= 1
                status = self.status
            return status, self.delay_s, self.lie


class Handler(BaseHTTPRequestHandler):
    server_version = "timeslice-sim-inference/1"
    protocol_version = "HTTP/1.1"

    # -- plumbing --------------------------------------------------------------
    def log_message(self, fmt, *args) -> None:  # quiet: one JSON line per call instead
        pass

    def _reply(self, status: int, doc: dict | None = None) -> None:
        body = b"" if doc is None else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"body of {n} bytes exceeds {MAX_BODY}")
        raw = self.rfile.read(n) if n else b""
        doc = json.loads(raw) if raw.strip() else {}
        if not isinstance(doc, dict):
            raise ValueError("body must be a JSON object")
        return doc

    @property
    def mem(self) -> ServerMemory:
        return self.server.mem  # type: ignore[attr-defined]

    @property
    def flavor(self) -> str:
        return self.server.flavor  # type: ignore[attr-defined]

    def _memory_call(self, fn) -> None:
        """Run one documented memory call, through the injected faults."""
        status, delay, lie = self.server.faults.take()  # type: ignore[attr-defined]
        if delay:
            time.sleep(delay)
        if status:
            self._reply(status, {"error": f"simulated fault {status}"})
            return
        if lie:
            self._reply(200)
            return
        try:
            fn()
        except DeviceOutOfMemory as exc:
            self._reply(500, {"error": str(exc)})
            return
        except (ValueError, KeyError) as exc:
            self._reply(400, {"error": str(exc)[:200]})
            return
        self._reply(200)

    # -- routes ------------------------------------------------------------------
    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._reply(200)
        elif path == "/is_sleeping" and self.flavor == VLLM:
            self._reply(200, {"is_sleeping": self.mem.any_released()})
        elif path == "/sim/memory":
            self._reply(200, self.mem.describe())
        else:
            self._reply(404, {"error": f"no route GET {path[:64]}"})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        try:
            body = self._body()
        except ValueError as exc:
            self._reply(400, {"error": str(exc)[:200]})
            return
        if url.path == "/sim/fault":
            f = self.server.faults  # type: ignore[attr-defined]
            with f.lock:
                f.status, f.count = int(body.get("status", 0)), int(body.get("count", 0))
                f.delay_s, f.lie = float(body.get("delay_s", 0.0)), bool(body.get("lie", False))
            self._reply(200)
        elif self.flavor == VLLM and url.path == "/sleep":
            level = int((query.get("level") or ["1"])[0])
            if level not in (1, 2):
                self._reply(400, {"error": f"level must be 1 or 2, got {level}"})
                return
            self._memory_call(lambda: self.mem.vllm_sleep(level))
        elif self.flavor == VLLM and url.path == "/wake_up":
            self._memory_call(lambda: self.mem.resume(query.get("tags") or None))
        elif self.flavor == SGLANG and url.path == "/release_memory_occupation":
            self._memory_call(lambda: self.mem.release(body.get("tags"), None))
        elif self.flavor == SGLANG and url.path == "/resume_memory_occupation":
            self._memory_call(lambda: self.mem.resume(body.get("tags")))
        else:
            self._reply(404, {"error": f"no route POST {url.path[:64]}"})


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
          seed: int = 0) -> ThreadingHTTPServer:
    """Allocate the regions on the simulated device and return the (not yet serving) server."""
    dev = SimDeviceClient.open(sim_dir)
    rnd = random.Random(seed)
    mem = ServerMemory(dev, context_bytes, [Region(n, s, p) for n, s, p in regions], rnd, gbps)
    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    httpd.mem, httpd.flavor, httpd.faults = mem, flavor, Faults()  # type: ignore[attr-defined]
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
    a = ap.parse_args(argv)
    specs = a.region or (["weights=8MiB", "kv_cache=4MiB"])
    regions = [_region(s, a.flavor) for s in specs]
    httpd = serve(a.flavor, regions, a.host, a.port, a.sim_dir, a.context_bytes, a.gbps, a.seed)
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

