"""SIMULATOR: the HTTP routes of the stand-in inference server (``inference_server``).

One handler serves both flavours: the memory endpoints (``server_memory``), the
generation and pause endpoints (``server_engine``) and the simulator's test
hooks under ``/sim/``. Memory and pause calls go through the injected faults.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from timeslice.common import swaps
from timeslice.common.device_errors import DeviceOutOfMemory
from timeslice.testing.standin.engine import Engine, EngineBusy, EngineDead, PauseCancelled
from timeslice.testing.standin.memory import ServerMemory

VLLM, SGLANG = swaps.VLLM, swaps.SGLANG          # the APIs it stands in for
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
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass      # the caller gave up (its deadline); nothing to tell it

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

    @property
    def engine(self) -> Engine:
        return self.server.engine  # type: ignore[attr-defined]

    def _control_call(self, fn) -> None:
        """Run one documented memory or pause call, through the injected faults."""
        status, delay, lie = self.server.faults.take()  # type: ignore[attr-defined]
        if delay:
            time.sleep(delay)
        if status:
            self._reply(status, {"error": f"simulated fault {status}"})
            return
        if lie:
            self._reply(200)
            return
        if self._answered(fn, {(DeviceOutOfMemory, EngineDead): 500, PauseCancelled: 409, (ValueError, KeyError): 400}):
            self._reply(200)

    def _answered(self, fn, statuses: dict) -> tuple | bool:
        """``fn()``'s result (True if none); False once an exception ``statuses`` names (exception class or
        classes -> HTTP status) is answered with its status and message (bounded for a 400)."""
        try:
            return fn() or True
        except tuple(k for ks in statuses for k in (ks if isinstance(ks, tuple) else (ks,))) as exc:
            status = next(st for ks, st in statuses.items() if isinstance(exc, ks))
            self._reply(status, {"error": str(exc)[:200] if status == 400 else str(exc)})
            return False

    def _generate(self, tokens) -> None:
        got = self._answered(lambda: self.engine.generate(int(tokens)),
                             {EngineDead: 500, EngineBusy: 503, (TypeError, ValueError): 400})
        if not isinstance(got, tuple):
            return
        done, reason = got
        text = " tok" * done
        if self.flavor == VLLM:
            self._reply(200, {"choices": [{"text": text, "finish_reason": reason}],
                              "usage": {"completion_tokens": done}})
        else:
            self._reply(200, {"text": text, "meta_info": {"finish_reason": {"type": reason},
                                                          "completion_tokens": done}})

    # -- routes ------------------------------------------------------------------
    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/sim/memory":
            self._reply(200, self.mem.describe())
        elif path == "/sim/requests":
            self._reply(200, self.engine.describe())
        elif self.engine.crashed:
            self._reply(500, {"error": self.engine.crashed})
        elif path == "/health":
            self._reply(200)
        elif path == "/is_sleeping" and self.flavor == VLLM:
            self._reply(200, {"is_sleeping": self.mem.any_released()})
        elif path == "/is_paused" and self.flavor == VLLM:
            self._reply(200, {"is_paused": bool(self.engine.paused)})
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
        elif self.engine.crashed:
            self._reply(500, {"error": self.engine.crashed})
        elif self.flavor == VLLM:
            self._vllm_post(url.path, query, body)
        else:
            self._sglang_post(url.path, body)

    def _pause(self, mode, modes: tuple[str, ...]) -> None:
        if mode not in modes:
            self._reply(400, {"error": f"mode must be {', '.join(modes[:-1])} or {modes[-1]}, got {str(mode)[:16]!r}"})
            return
        self._control_call(lambda: self.engine.pause(mode))

    def _vllm_post(self, path: str, query: dict, body: dict) -> None:
        if path == "/v1/completions":
            self._generate(body.get("max_tokens", 16))
        elif path == "/pause":
            mode = (query.get("mode") or ["abort"])[0]
            if (query.get("wait_for_inflight_requests") or ["false"])[0].lower() == "true":
                mode = "wait"
            self._pause(mode, ("abort", "wait", "keep"))
        elif path == "/resume":
            self._control_call(self.engine.resume)
        elif path == "/sleep":
            level = int((query.get("level") or ["1"])[0])
            if level not in (1, 2):
                self._reply(400, {"error": f"level must be 1 or 2, got {level}"})
                return
            self._control_call(lambda: self.mem.vllm_sleep(level))
        elif path == "/wake_up":
            self._control_call(lambda: self.mem.resume(query.get("tags") or None))
        else:
            self._reply(404, {"error": f"no route POST {path[:64]}"})

    def _sglang_post(self, path: str, body: dict) -> None:
        if path == "/generate":
            params = body.get("sampling_params") or {}
            self._generate(params.get("max_new_tokens", 16) if isinstance(params, dict) else "bad")
        elif path == "/pause_generation":
            self._pause(body.get("mode", "abort"), ("abort", "retract", "in_place"))
        elif path == "/continue_generation":
            self._control_call(self.engine.resume)
        elif path == "/release_memory_occupation":
            self._control_call(lambda: self.mem.release(body.get("tags"), None))
        elif path == "/resume_memory_occupation":
            self._control_call(lambda: self.mem.resume(body.get("tags")))
        else:
            self._reply(404, {"error": f"no route POST {path[:64]}"})
