"""The node's capabilities for the liveness key: devices, free memory, resident jobs.

The leader decides elision from these figures (does the incoming job fit in
free device memory beside the resident one?), so they are read fresh from the
devices, never remembered: NVML on NVIDIA, the ledger on the simulator, the
backend's own free-memory figure otherwise. Blocking; call through a thread.
"""
from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

import structlog

from timeslice.common.device_errors import BackendError
from timeslice.common.server import records as R
from timeslice.nodeagent.backends.base import Backend
from timeslice.nodeagent.hostmem import HostMemory

if TYPE_CHECKING:   # for the annotation only: the module is imported on first use (_nvml_gpus)
    from timeslice.nodeagent.backends.nvml import Nvml

log = structlog.get_logger(__name__)


def version() -> str:
    try:
        return metadata.version("timeslice")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Inventory:
    def __init__(self, backend: Backend, host: HostMemory):
        self.backend, self.host = backend, host
        self._nvml: Nvml | None = None
        self._nvml_tried = False

    def _sim_gpus(self) -> list[dict] | None:
        dev = getattr(self.backend, "dev", None)
        if self.backend.name != "sim" or dev is None:
            return None
        capacity = dev.ledger.layout()[0]
        from timeslice.common.sim.device import device_id
        return [{"index": g, "uuid": device_id(g), "total_bytes": capacity, "free_bytes": free}
                for g, free in enumerate(dev.free_per_gpu())]

    def _nvml_gpus(self) -> list[dict] | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                from timeslice.nodeagent.backends.nvml import Nvml
                self._nvml = Nvml.open()
            except BackendError as e:
                log.info("nvml_unavailable", error=str(e))
        if self._nvml is None:
            return None
        try:
            return [{"index": g.index, "uuid": g.uuid, "total_bytes": g.total_bytes, "free_bytes": g.free_bytes}
                    for g in self._nvml.gpus()]
        except Exception as e:  # NVML errors must not stop the liveness key
            log.warning("nvml_query_failed", error=str(e))
            return None

    def gpus(self) -> list[dict]:
        found = self._sim_gpus()
        if found is None:
            found = self._nvml_gpus()
        if found is None:
            free = self.backend.device_free() or {}
            found = [{"index": i, "uuid": dev, "total_bytes": 0, "free_bytes": n}
                     for i, (dev, n) in enumerate(sorted(free.items()))]
        return found

    def agent_value(self, node: str, endpoint: str, job_device_bytes: dict[str, int],
                    job_gpus: dict[str, dict[str, int]] | None = None,
                    job_unknown: list[str] | None = None) -> R.AgentValue:
        gpus = self.gpus()
        return R.AgentValue(
            node=node, backend=self.backend.name, version=version(), gpus=gpus,
            device_total_bytes=sum(g["total_bytes"] for g in gpus),
            device_free_bytes=sum(g["free_bytes"] for g in gpus),
            host_free_bytes=self.host.available_bytes(),
            job_device_bytes=dict(sorted(job_device_bytes.items())),
            updated_ms=R.now_ms(), endpoint=endpoint,
            job_gpus={j: dict(sorted(d.items())) for j, d in sorted((job_gpus or {}).items())},
            job_unknown=sorted(job_unknown or ()))

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None


def differs(old: R.AgentValue | None, new: R.AgentValue, host_slack: int = 64 << 20) -> bool:
    """True when ``new`` says something the leader should see (not just a newer clock).

    Free host memory wobbles all the time; it counts only when it moved by
    more than ``host_slack`` bytes or 5 %.
    """
    if old is None:
        return True
    a, b = dict(old.__dict__), dict(new.__dict__)
    for k in ("updated_ms", "host_free_bytes"):
        a.pop(k), b.pop(k)
    if a != b:
        return True
    d = abs(old.host_free_bytes - new.host_free_bytes)
    return d > max(host_slack, 0.05 * max(old.host_free_bytes, 1))
