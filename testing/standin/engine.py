"""SIMULATOR: the request side of the stand-in inference server — admission, in-flight requests, pause.

A generate request decodes ``tokens`` tokens, one every ``token_s`` seconds, each
step a device operation of the server (``SimDeviceClient.compute``, so it waits
while the server's context is checkpointed). The engine tracks every request:

* ``held``: admitted while generation is paused, not started; not on the device;
* ``running``: decoding, its KV cache on the device;
* ``frozen``: paused in place (vLLM ``keep``, SGLang ``in_place``): not decoding but
  still holding its KV cache;
* ``retracted`` (SGLang ``retract``): sent back to the waiting queue, its KV cache
  dropped, its progress kept; it continues after the resume.

The real servers do not survive their memory being released under a request:
vLLM's engine core dies when put to sleep with requests in flight, and SGLang's
``release_memory_occupation`` asserts that the scheduler is idle. So here a
release while a request is running or frozen *crashes* the engine: every
in-flight request fails (HTTP 500) and so does every later call.

Pause modes, as the servers name them: ``abort`` (in-flight requests end now,
finish reason ``abort``), ``wait`` (vLLM: the pause returns once the in-flight
requests have finished; new ones are held), ``keep`` / ``in_place`` (frozen) and
``retract``. Every mode holds new requests until the resume, and a pause returns
only once no request is mid-step.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

HELD, RUNNING, FROZEN, RETRACTED = "held", "running", "frozen", "retracted"
PAUSE_MODES = frozenset({"abort", "wait", "keep", "in_place", "retract"})
MAX_REQUESTS = 256          # in flight and held together; more are refused (HTTP 503)
MAX_TOKENS = 100_000        # one request's length bound
WAKE_S = 0.05               # how often a blocked request or pause looks again


class EngineDead(Exception):
    """The engine crashed (memory released under a request): every call fails."""


class EngineBusy(Exception):
    """Too many requests in flight."""


class PauseCancelled(Exception):
    """A resume arrived while the pause was still waiting for requests."""


@dataclass
class GenerateRequest:
    rid: int
    tokens: int
    done: int = 0
    state: str = HELD
    started: bool = False
    aborted: bool = False


class Engine:
    def __init__(self, token_s: float, step: Callable[[], None], resident: Callable[[], bool]):
        """``step``: one device operation per token; ``resident``: whether the model's memory is there."""
        self.token_s, self._step, self._resident = token_s, step, resident
        self.cv = threading.Condition()
        self.paused = ""                    # "" or the pause mode
        self.crashed = ""                   # why the engine died ("" = alive)
        self.active: dict[int, GenerateRequest] = {}
        self._ids = itertools.count(1)
        self.completed = self.aborted = self.failed = 0

    # -- requests ------------------------------------------------------------------
    def generate(self, tokens: int) -> tuple[int, str]:
        """Decode ``tokens`` tokens; (tokens decoded, finish reason). EngineDead / EngineBusy / ValueError."""
        if not 0 < tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be in [1, {MAX_TOKENS}], got {tokens}")
        with self.cv:
            if self.crashed:
                raise EngineDead(self.crashed)
            if len(self.active) >= MAX_REQUESTS:
                raise EngineBusy(f"{len(self.active)} requests in flight")
            req = GenerateRequest(next(self._ids), tokens)
            self.active[req.rid] = req
        try:
            while req.done < req.tokens:
                with self.cv:
                    if not self._may_decode(req):
                        return self._finish(req, "abort")
                if not self._resident():
                    # Only reachable when a release did not crash us: the model is not there.
                    raise EngineDead("decode step with the model's memory released")
                self._step()
                time.sleep(self.token_s)
                with self.cv:
                    req.done += 1
            with self.cv:
                return self._finish(req, "length")
        except EngineDead:
            with self.cv:
                self.failed += 1
            raise
        finally:
            with self.cv:
                self.active.pop(req.rid, None)
                if req.state == RUNNING:
                    req.state = HELD
                self.cv.notify_all()

    def _may_decode(self, req: GenerateRequest) -> bool:
        """Under ``cv``: block until ``req`` may take its next step; False if it was aborted."""
        while True:
            if self.crashed:
                raise EngineDead(self.crashed)
            if req.aborted:
                return False
            mode = self.paused
            if not mode or (mode == "wait" and req.started):
                req.state, req.started = RUNNING, True
                return True
            if req.started and mode in ("keep", "in_place"):
                req.state = FROZEN
            elif req.started and mode == "retract":
                req.state = RETRACTED
            else:
                req.state = HELD
            self.cv.notify_all()
            self.cv.wait(WAKE_S)

    def _finish(self, req: GenerateRequest, reason: str) -> tuple[int, str]:
        if reason == "abort":
            self.aborted += 1
        else:
            self.completed += 1
        return req.done, reason

    # -- control ---------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        """Stop decoding as ``mode`` says; returns once no request is mid-step (``wait``: finished)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode[:16]!r}")
        with self.cv:
            if self.crashed:
                raise EngineDead(self.crashed)
            self.paused = mode
            if mode == "abort":
                for r in self.active.values():
                    if r.started:
                        r.aborted = True
            self.cv.notify_all()
            while any(r.state == RUNNING for r in self.active.values()):
                if self.crashed:
                    raise EngineDead(self.crashed)
                if self.paused != mode:
                    raise PauseCancelled(f"resumed while the {mode} pause was waiting")
                self.cv.wait(WAKE_S)

    def resume(self) -> None:
        with self.cv:
            if self.crashed:
                raise EngineDead(self.crashed)
            self.paused = ""
            self.cv.notify_all()

    def before_release(self, what: str) -> None:
        """Called before device memory is released: with a request on it, the engine dies."""
        with self.cv:
            if self.crashed:
                raise EngineDead(self.crashed)
            busy = [r for r in self.active.values() if r.state in (RUNNING, FROZEN)]
            if busy:
                self.crashed = f"{what} with {len(busy)} request(s) in flight: the engine died"
                self.cv.notify_all()
                raise EngineDead(self.crashed)

    def check_alive(self) -> None:
        with self.cv:
            if self.crashed:
                raise EngineDead(self.crashed)

    def describe(self) -> dict:
        with self.cv:
            states = [r.state for r in self.active.values()]
            return {"paused": self.paused, "crashed": self.crashed, "in_flight": len(states),
                    **{s: states.count(s) for s in (HELD, RUNNING, FROZEN, RETRACTED)},
                    "completed": self.completed, "aborted": self.aborted, "failed": self.failed}
