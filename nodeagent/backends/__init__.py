"""Checkpoint backends behind one interface (``base.Backend``), picked by what the node has.

    backend = pick_backend("auto")          # or "cuda-driver" | "cuda-cli" | "sim"
    backend.name, backend.why               # which one, and why it was chosen
    result = ops.snapshot_processes(backend, pids, lock_timeout_ms=10_000)

``auto`` prefers the driver API (no extra binary), then the ``cuda-checkpoint``
tool, then the simulated device. Options are passed to the chosen backend's
constructor; those that belong to another backend are ignored, so one call
works on every node.
"""
from __future__ import annotations

import inspect

import structlog

from timeslice.common.device_errors import BackendError, BackendUnavailable
from timeslice.nodeagent.backends.base import Backend, ProcState

log = structlog.get_logger(__name__)

NAMES = ("cuda-driver", "cuda-cli", "sim")

__all__ = ["NAMES", "Backend", "ProcState", "pick_backend"]


def _build(cls, opts: dict):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in opts.items() if k in accepted})


def _driver(opts: dict, auto: bool) -> Backend:
    from timeslice.nodeagent.backends.cuda_driver import CudaDriverBackend
    return _build(CudaDriverBackend, opts)


def _cli(opts: dict, auto: bool) -> Backend:
    from timeslice.nodeagent.backends.cuda_cli import CudaCliBackend, find_binary
    if auto and find_binary():
        # The tool alone proves nothing: on a node without a GPU, auto must
        # fall through to the simulator rather than drive a tool that cannot work.
        from timeslice.nodeagent.backends.nvml import Nvml
        nvml = Nvml.open()  # BackendUnavailable without the NVIDIA driver
        try:
            if not nvml.gpus():
                raise BackendUnavailable("cuda-checkpoint is present but NVML lists no GPU")
        finally:
            nvml.close()
    return _build(CudaCliBackend, opts)


def _sim(opts: dict, auto: bool) -> Backend:
    from timeslice.nodeagent.backends.sim import SimBackend
    return _build(SimBackend, opts)


_FACTORIES = {"cuda-driver": _driver, "cuda-cli": _cli, "sim": _sim}


def pick_backend(name: str = "auto", **opts) -> Backend:
    """Build the named backend, or the best available one for ``auto``.

    An explicitly named backend that cannot run raises ``BackendUnavailable``
    (an operator who asked for the GPU must not silently get the simulator).
    The returned backend's ``why`` says why it was chosen; the choice is logged
    as ``backend_picked``.
    """
    if name != "auto":
        if name not in _FACTORIES:
            raise BackendUnavailable(f"unknown backend {name!r}; choose one of auto, {', '.join(NAMES)}")
        backend = _FACTORIES[name](opts, False)
        backend.why = f"requested explicitly ({name})"
        log.info("backend_picked", backend=backend.name, why=backend.why)
        return backend
    passed_over = []
    for candidate in NAMES:
        try:
            backend = _FACTORIES[candidate](opts, True)
        except BackendError as exc:
            passed_over.append(f"{candidate}: {exc}")
            continue
        reasons = {"cuda-driver": "libcuda.so.1 has the checkpoint API and a GPU is present",
                   "cuda-cli": f"cuda-checkpoint found at {getattr(backend, 'binary', '?')}",
                   "sim": "no usable GPU backend; using the SIMULATED device"}
        backend.why = reasons[candidate] + (f" (passed over: {'; '.join(passed_over)})" if passed_over else "")
        log.info("backend_picked", backend=backend.name, why=backend.why, simulated=candidate == "sim")
        return backend
    raise BackendUnavailable("no backend available: " + "; ".join(passed_over))
