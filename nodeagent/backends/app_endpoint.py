"""App-endpoint swappers: an inference server releases its own GPU memory over HTTP.

RL samplers are inference servers; vLLM and SGLang can give their device
memory back and take it again through their own APIs, which is far cheaper
than checkpointing the whole process:

* ``VllmSwapper`` — vLLM sleep mode (``VLLM_SERVER_DEV_MODE=1``,
  ``--enable-sleep-mode``): ``POST /sleep?level=1|2``, ``POST /wake_up``,
  ``GET /is_sleeping``. Level 1 offloads the weights to host memory and drops
  the KV cache; level 2 drops both. The level comes from the worker's tags at
  registration: ``weights=discard`` asks level 2, anything else level 1.
* ``SglangSwapper`` — SGLang (``--enable-memory-saver``):
  ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` with
  ``{"tags": [...]}``; the tags registered with the worker are the regions
  moved (none registered: all of them).

Drain before sleep. A server put to sleep with requests in flight does not
survive it (vLLM's engine dies; SGLang's release asserts an idle scheduler), so
before releasing anything the swapper quiesces the server with its own API:

* vLLM: ``POST /pause?mode=wait`` — stop admitting (new requests are held until
  the resume) and return once the in-flight requests have finished — bounded by
  the drain deadline; then ``/sleep``. The resume is ``/wake_up`` then ``POST /resume``.
* SGLang: ``POST /pause_generation {"mode": "retract"}`` — running requests go
  back to the waiting queue (their KV cache may then be dropped; they continue
  after the resume), new ones wait; then ``/release_memory_occupation``. The
  resume is ``/resume_memory_occupation`` then ``POST /continue_generation``.

The drain gets ``drain_s`` seconds (default: half the pause's deadline). If the
in-flight requests have not finished by then, ``on_drain_timeout`` decides:
``refuse`` (default) resumes generation and fails the swap (``SwapTimeout``):
nothing is released, no request is lost and the server serves on;
``abort`` aborts the remaining requests (vLLM ``mode=abort``, SGLang
``mode=abort``: their clients get finish reason "abort") and sleeps. Both
outcomes are logged (``app_drain_refused`` / ``app_drain_aborted``). A pause that
fails after the drain resumes generation again.

Each call has a deadline. Transient failures — connection refused or reset
while the server restarts, HTTP 502/503/504 — are retried with jittered
backoff (tenacity) until the deadline; anything else fails at once. After the
server answers, the swapper *verifies* through a ``DeviceMeter`` (NVML on a
GPU, the simulated device in CI) that the worker's device memory actually went
down (pause) or came back (resume): a server that answers 200 and keeps its
memory is a failed swap (``SwapNotVerified``), never a silent success.

Only the standard library's HTTP client is used (``app_http``). The worker's ``pid`` is the
process that holds the device memory (the meter reads it); ``endpoint`` is the
server's base URL. Tested against ``timeslice.testing.standin.server``, a
simulator of the documented endpoints.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from urllib.parse import urlencode

import structlog
import tenacity

from timeslice.common import procfs, swaps
from timeslice.common.device_errors import BackendError, ProcessGone
from timeslice.common.server import records as R
from timeslice.nodeagent.backends.app_http import ServerApi, as_meter
from timeslice.nodeagent.backends.base import DeviceMeter
from timeslice.nodeagent.backends.swapper import (
    SwapConfigError,
    SwapEnv,
    Swapper,
    SwapRefused,
    SwapReport,
    SwapState,
    SwapTimeout,
    swapper_class,
)

log = structlog.get_logger(__name__)

VERIFY_POLL_S = 0.01          # how often the meter is read while waiting for memory to move
STATE_TIMEOUT_S = 2.0         # state() is a quick look, not a swap
DRAIN_REFUSE, DRAIN_ABORT = "refuse", "abort"
DRAIN_POLICIES = (DRAIN_REFUSE, DRAIN_ABORT)


def _last_reading(rs: tenacity.RetryCallState) -> int | None:
    """On giving up, the last meter reading (not an error: the caller compares it)."""
    assert rs.outcome is not None       # the callback runs after an attempt, so there is one
    return rs.outcome.result()


class SwapNotVerified(SwapRefused):
    """The server answered, but the meter did not see its device memory move."""


class AppEndpointSwapper(Swapper):
    """Shared HTTP, retry and verification logic; subclasses map pause/resume to calls."""

    kind = "app-endpoint"

    @classmethod
    def for_worker(cls, env: SwapEnv, pid: int, job: str, worker: R.WorkerValue | None) -> Swapper:
        if worker is None:
            raise SwapConfigError(f"pid {pid}: only a registration names an app server's endpoint")
        return make_app_swapper(worker, env.meter, drain_s=env.drain_s, on_drain_timeout=env.on_drain_timeout)

    def __init__(self, worker: R.WorkerValue, meter: DeviceMeter | None, *, proc_root: str = procfs.PROC_ROOT,
                 drain_s: float | None = None, on_drain_timeout: str = DRAIN_REFUSE):
        if drain_s is not None and drain_s <= 0:
            raise SwapConfigError(f"drain_s must be > 0 (None: half the pause's deadline), got {drain_s}")
        if on_drain_timeout not in DRAIN_POLICIES:
            raise SwapConfigError(f"on_drain_timeout must be one of {DRAIN_POLICIES}, got {on_drain_timeout[:16]!r}")
        self.worker, self.meter, self.proc_root = worker, as_meter(meter), proc_root
        self.drain_s, self.on_drain_timeout = drain_s, on_drain_timeout
        self.api = ServerApi(worker.endpoint, worker.pid, self.kind, proc_root)
        self._paused = False
        self._released: int | None = None      # device bytes the last pause freed
        self._before: int | None = None        # device bytes held before the last pause
        self._host_bytes = 0

    # -- verification --------------------------------------------------------------------
    def _held(self) -> int | None:
        if self.meter is None:
            return None
        usage = self.meter.usage(self.worker.pid)
        return None if usage is None else sum(usage.values())

    def _await_memory(self, want, deadline: float) -> int | None:
        """Poll the meter until ``want(bytes)`` holds; the bytes then, None if unknowable."""
        held = self._held()
        if held is None:
            return None
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda b: b is not None and not want(b)),
            wait=tenacity.wait_fixed(VERIFY_POLL_S),
            stop=lambda rs: time.monotonic() >= deadline,
            retry_error_callback=_last_reading)
        return retrying(self._held)

    # -- the Swapper interface --------------------------------------------------------
    def paused_bytes(self) -> int | None:
        return self._released if self._paused else None

    def host_bytes(self) -> int:
        return self._host_bytes if self._paused else 0

    def _gone_or(self, default: SwapState) -> SwapState:
        return SwapState.GONE if not procfs.is_alive(self.worker.pid, self.proc_root) else default

    def _pause_call(self, tags: Sequence[str] | None, deadline: float) -> tuple[list[str], bool]:
        """Ask the server to release; returns (tags acted on, whether anything goes to host memory)."""
        raise NotImplementedError

    def _resume_call(self, deadline: float) -> None:
        """Ask the server to take its memory back."""
        raise NotImplementedError

    def _stop_generation(self, deadline: float) -> None:
        """Stop admitting and wait until no request is on the device; SwapTimeout at ``deadline``."""
        raise NotImplementedError

    def _abort_generation(self, deadline: float) -> None:
        """Abort the requests still in flight (generation stays stopped)."""
        raise NotImplementedError

    def _start_generation(self, deadline: float) -> None:
        raise NotImplementedError

    def _drain(self, deadline: float) -> dict:
        """Quiesce the server before its memory goes; the figures for the report."""
        t0 = time.monotonic()
        budget = self.drain_s if self.drain_s is not None else (deadline - t0) / 2
        try:
            self._stop_generation(min(deadline, t0 + budget))
            return {"drain_ms": round((time.monotonic() - t0) * 1000, 2)}
        except SwapTimeout as exc:
            if self.on_drain_timeout == DRAIN_ABORT:
                self._abort_generation(deadline)
                log.warning("app_drain_aborted", kind=self.kind, pid=self.worker.pid, drain_s=round(budget, 2))
                return {"drain_ms": round((time.monotonic() - t0) * 1000, 2), "aborted_in_flight": True}
            self._start_quietly(deadline)
            log.warning("app_drain_refused", kind=self.kind, pid=self.worker.pid, drain_s=round(budget, 2))
            raise SwapTimeout(f"{self.kind} drain: requests still in flight after {budget:.2f}s; generation "
                              f"resumed and nothing released ({exc})", pid=self.worker.pid) from exc

    def _start_quietly(self, deadline: float) -> None:
        try:
            self._start_generation(max(deadline, time.monotonic() + STATE_TIMEOUT_S))
        except BackendError as exc:
            log.warning("app_generation_restart_failed", kind=self.kind, pid=self.worker.pid, error=str(exc)[:200])

    def pause(self, tags: Sequence[str] | None, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        if self._paused:
            return SwapReport(elapsed_ms=0.0, detail={"already": "paused"})
        before = self._held()
        drained = self._drain(deadline)
        try:
            acted, offloads = self._pause_call(tags, deadline)
        except BackendError:
            self._start_quietly(deadline)        # nothing released: serve on
            raise
        after = before
        if before:
            after = self._await_memory(lambda b: b < before, deadline)
            if after is not None and after >= before:
                # The server said yes; the device says no. Its memory is where it was.
                self._resume_quietly(deadline_s)
                raise SwapNotVerified(f"{self.kind} pause: server answered but pid {self.worker.pid} "
                                      f"still holds {after} of {before} device bytes", pid=self.worker.pid)
        freed = None if before is None or after is None else before - after
        self._paused, self._released, self._before = True, freed, before
        self._host_bytes = (freed or 0) if offloads else 0
        rep = SwapReport(bytes_moved=self._host_bytes, device_bytes=freed or 0,
                         elapsed_ms=(time.monotonic() - t0) * 1000, tags=acted,
                         detail={"verified": freed is not None, "bytes_moved_upper_bound": offloads,
                                 "endpoint": self.worker.endpoint, **drained})
        log.info("app_swap_paused", kind=self.kind, pid=self.worker.pid, freed=freed, tags=acted,
                 elapsed_ms=round(rep.elapsed_ms, 2), drain_ms=drained.get("drain_ms"))
        return rep

    def _resume_quietly(self, deadline_s: float) -> None:
        try:
            self._resume_call(time.monotonic() + deadline_s)
        except BackendError as exc:
            log.warning("app_swap_undo_failed", kind=self.kind, pid=self.worker.pid, error=str(exc)[:200])
            return
        self._start_quietly(time.monotonic() + deadline_s)

    def resume(self, deadline_s: float) -> SwapReport:
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        if not self._paused:
            return SwapReport(elapsed_ms=0.0, detail={"already": "running"})
        during = self._held()
        self._resume_call(deadline)
        back = None
        if during is not None and self._released:
            # Back means more than while paused, or as much as before the pause (an earlier
            # resume that timed out here may have completed on the server since).
            before = self._before

            def back_again(b: int) -> bool:
                return b > during or (before is not None and b >= before)
            after = self._await_memory(back_again, deadline)
            if after is not None and not back_again(after):
                raise SwapNotVerified(f"{self.kind} resume: server answered but pid {self.worker.pid} "
                                      f"holds {after} device bytes, as while paused", pid=self.worker.pid)
            back = None if after is None else after - during
        self._start_generation(deadline)     # the memory is back: admit requests again
        moved = self._host_bytes
        self._paused, self._released, self._host_bytes = False, None, 0
        rep = SwapReport(bytes_moved=moved, device_bytes=back or 0,
                         elapsed_ms=(time.monotonic() - t0) * 1000,
                         detail={"verified": back is not None, "endpoint": self.worker.endpoint})
        log.info("app_swap_resumed", kind=self.kind, pid=self.worker.pid, back=back,
                 elapsed_ms=round(rep.elapsed_ms, 2))
        return rep


class VllmSwapper(AppEndpointSwapper):
    """vLLM sleep mode. The level: 2 if the worker registered ``weights=discard``, else 1."""

    kind = swaps.VLLM

    def __init__(self, worker: R.WorkerValue, meter: DeviceMeter | None, **kw):
        super().__init__(worker, meter, **kw)
        unknown = set(worker.tags) - {"weights", "kv_cache"}
        if unknown:
            raise SwapConfigError(f"vllm: tags are weights and kv_cache, got {sorted(unknown)[:4]}")
        if worker.tags.get("kv_cache", R.TAG_DISCARD) != R.TAG_DISCARD:
            raise SwapConfigError("vllm: sleep always discards the KV cache (kv_cache=discard)")
        self.level = 2 if worker.tags.get("weights") == R.TAG_DISCARD else 1

    def state(self) -> SwapState:
        try:
            raw = self.api.call("GET", "/is_sleeping", None, time.monotonic() + STATE_TIMEOUT_S)
            return SwapState.PAUSED if json.loads(raw).get("is_sleeping") else SwapState.RUNNING
        except ProcessGone:
            return SwapState.GONE
        except (BackendError, ValueError, AttributeError):
            return self._gone_or(SwapState.UNKNOWN)

    def _pause_call(self, tags, deadline):
        # Sleep acts on the whole engine: vLLM cannot release only some regions.
        self.api.call("POST", "/sleep?" + urlencode({"level": self.level}), None, deadline)
        return ["weights", "kv_cache"], self.level == 1

    def _resume_call(self, deadline):
        self.api.call("POST", "/wake_up", None, deadline)

    def _stop_generation(self, deadline):
        # mode=wait: the call returns once the in-flight requests are done (older servers
        # spell it wait_for_inflight_requests=true; each ignores the other's parameter).
        self.api.call("POST", "/pause?" + urlencode({"mode": "wait", "wait_for_inflight_requests": "true"}),
                      None, deadline)

    def _abort_generation(self, deadline):
        self.api.call("POST", "/pause?" + urlencode({"mode": "abort"}), None, deadline)

    def _start_generation(self, deadline):
        self.api.call("POST", "/resume", None, deadline)


class SglangSwapper(AppEndpointSwapper):
    """SGLang's release/resume_memory_occupation over the registered tags (none: all regions)."""

    kind = swaps.SGLANG

    def __init__(self, worker: R.WorkerValue, meter: DeviceMeter | None, **kw):
        super().__init__(worker, meter, **kw)
        self._tags: list[str] | None = None

    def state(self) -> SwapState:
        # SGLang has no "is released" query: the server's health, and what we asked last.
        try:
            self.api.call("GET", "/health", None, time.monotonic() + STATE_TIMEOUT_S)
        except ProcessGone:
            return SwapState.GONE
        except BackendError:
            return self._gone_or(SwapState.UNKNOWN)
        return SwapState.PAUSED if self._paused else SwapState.RUNNING

    def _pause_call(self, tags, deadline):
        registered = sorted(self.worker.tags)
        want = list(tags) if tags is not None else registered
        if tags is not None and registered:
            want = [t for t in want if t in self.worker.tags]
        body = {"tags": want} if want else {}
        self.api.call("POST", "/release_memory_occupation", body, deadline)
        self._tags = want or None
        policies = [self.worker.tags.get(t, R.TAG_DISCARD) for t in want]
        offloads = (not want) or R.TAG_OFFLOAD in policies
        return want, offloads

    def _resume_call(self, deadline):
        self.api.call("POST", "/resume_memory_occupation", {"tags": self._tags} if self._tags else {}, deadline)

    def _stop_generation(self, deadline):
        # retract: running requests go back to the waiting queue and continue after the resume.
        self.api.call("POST", "/pause_generation", {"mode": "retract"}, deadline)

    def _abort_generation(self, deadline):
        self.api.call("POST", "/pause_generation", {"mode": "abort"}, deadline)

    def _start_generation(self, deadline):
        self.api.call("POST", "/continue_generation", {}, deadline)


def make_app_swapper(worker: R.WorkerValue, meter, **kw) -> Swapper:
    """The swapper for a worker registered with an app server's swap kind ("vllm", "sglang": the
    kinds ``common/swaps.py`` lists with ``endpoint``).

    ``meter`` verifies the server's memory: a ``DeviceMeter`` (NVML, ``SimMeter``) or a
    checkpoint ``Backend`` (its ``device_usage``); None turns verification off."""
    kind = swaps.kind_of(worker.swap)
    if kind is None or not kind.endpoint:
        raise SwapConfigError(f"no app-endpoint swapper for swap={worker.swap[:32]!r} "
                              f"(one of {sorted(k.name for k in swaps.KINDS.values() if k.endpoint)})")
    return swapper_class(kind.name)(worker, meter, **kw)  # type: ignore[call-arg]


__all__ = ["DRAIN_POLICIES", "AppEndpointSwapper", "SglangSwapper", "SwapConfigError", "SwapNotVerified", "VllmSwapper",
           "make_app_swapper"]
