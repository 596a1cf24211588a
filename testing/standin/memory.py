"""SIMULATOR: the device memory of a stand-in inference server (``inference_server``).

An inference server holds a few named regions (vLLM: ``weights``, ``kv_cache``;
SGLang: ``weights``, ``kv_cache``, ``cuda_graph``) on its GPU. Here each region
is a file of real bytes in the simulated device's directory
(``appmem-<pid>-<name>``), and the server's pid holds, in the device's capacity
ledger, its context (its arena) plus every resident region. Releasing a region
copies it to host memory first when its policy is ``offload`` (and only then
frees the device bytes), or drops it when ``discard``; resuming reserves the
capacity first (refused as out of memory if it does not fit: nothing changes,
the host copy is kept), then writes the bytes back and checks their sha256.

Every call is a device operation (``SimDeviceClient.compute``): while the
simulated checkpoint backend has the server's context locked or checkpointed,
a release or resume waits, as a CUDA call of a checkpointed server would. So
the agent can chain the two when full isolation is asked: pause through the
HTTP API, then checkpoint what is left (the context, ``arena-<pid>``, whose
size is then exactly what the ledger holds for the pid); and back in reverse.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from timeslice.sim.runtime import SimDeviceClient

OFFLOAD, DISCARD = "offload", "discard"
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """``64MiB`` / ``1GiB`` / ``4096`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {str(text)[:32]!r} (e.g. 64MiB)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass
class Region:
    name: str
    size: int
    policy: str                        # offload | discard, what a release does by default
    resident: bool = True
    sha256: str = ""                   # of the contents at fill time
    host: bytes | None = None          # the host copy while offloaded
    intact: bool = True                # False once its contents were discarded


class ServerMemory:
    def __init__(self, dev: SimDeviceClient, context_bytes: int, regions: list[Region],
                 rnd: random.Random, gbps: float = 0.0):
        self.dev, self.regions = dev, {r.name: r for r in regions}
        self.bps = gbps * 1e9
        self.lock = threading.Lock()
        # Called before any device bytes are released (the engine crashes if a request is on them).
        self.guard: Callable[[str], None] = lambda _what: None
        dev.alloc(max(1, context_bytes))
        self.context_bytes = max(1, context_bytes)
        for r in regions:
            self._reserve(self._resident_bytes())        # capacity first, then the bytes
            data = rnd.randbytes(r.size) if r.policy == OFFLOAD else bytes(r.size)
            r.sha256 = hashlib.sha256(data).hexdigest()
            self._write(r, data)

    # -- helpers ---------------------------------------------------------------
    def _path(self, r: Region):
        return self.dev.dev.root / f"appmem-{self.dev.pid}-{r.name}"

    def _resident_bytes(self) -> int:
        return self.context_bytes + sum(r.size for r in self.regions.values() if r.resident)

    def _reserve(self, nbytes: int) -> None:
        # Set, not add: the ledger entry is the server's whole holding.
        self.dev.dev.ledger.reserve(self.dev.pid, nbytes, self.dev.dev.is_dead)

    def _pace(self, nbytes: int, t0: float) -> None:
        if self.bps > 0:
            ahead = nbytes / self.bps - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _write(self, r: Region, data: bytes) -> None:
        t0 = time.monotonic()
        with open(self._path(r), "wb") as f:
            f.write(data)
        self._pace(len(data), t0)

    def _names(self, tags, resident: bool) -> list[Region]:
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise ValueError("tags must be a list of strings")
        names = tags if tags else list(self.regions)
        unknown = [n for n in names if n not in self.regions]
        if unknown:
            raise ValueError(f"unknown tags {unknown[:4]}; regions are {sorted(self.regions)}")
        return [self.regions[n] for n in names if self.regions[n].resident == resident]

    # -- the calls -------------------------------------------------------------------
    def release(self, tags: list[str] | None, policies: dict[str, str] | None) -> int:
        """Release the resident regions ``tags`` (None: all); returns the device bytes freed."""
        with self.lock, self.dev.compute():
            freed = 0
            todo = self._names(tags, resident=True)
            if todo:
                self.guard(f"released {', '.join(r.name for r in todo)}")
            for r in todo:
                policy = (policies or {}).get(r.name, r.policy)
                if policy == OFFLOAD:
                    t0 = time.monotonic()
                    data = self._path(r).read_bytes()
                    self._pace(len(data), t0)
                    if hashlib.sha256(data).hexdigest() != r.sha256 and r.intact:
                        raise ValueError(f"region {r.name}: device bytes changed under the simulator")
                    r.host = data                       # the host copy is complete ...
                else:
                    r.host, r.intact = None, False
                self._path(r).unlink(missing_ok=True)   # ... before the device bytes go
                r.resident = False
                freed += r.size
            self._reserve(self._resident_bytes())
            return freed

    def vllm_sleep(self, level: int) -> int:
        """vLLM: level 1 offloads the weights and discards the KV cache; level 2 discards both."""
        policies = {"weights": OFFLOAD if level == 1 else DISCARD, "kv_cache": DISCARD}
        return self.release(None, policies)

    def resume(self, tags: list[str] | None) -> int:
        """Bring back the released regions ``tags`` (None: all); DeviceOutOfMemory if they do not fit."""
        with self.lock, self.dev.compute():
            todo = self._names(tags, resident=False)
            need = self._resident_bytes() + sum(r.size for r in todo)
            self._reserve(need)        # raises DeviceOutOfMemory: nothing changed, host copies kept
            for r in todo:
                data = r.host if r.host is not None else bytes(r.size)
                self._write(r, data)
                if r.host is not None and hashlib.sha256(data).hexdigest() != r.sha256:
                    raise ValueError(f"region {r.name}: host copy corrupted")
                r.resident, r.host = True, None
            return sum(r.size for r in todo)

    # -- reading ---------------------------------------------------------------------
    def any_released(self) -> bool:
        with self.lock:
            return any(not r.resident for r in self.regions.values())

    def step(self) -> None:
        """One decode step: a device operation (it waits while the context is checkpointed)."""
        with self.dev.compute():
            pass

    def device_bytes(self) -> int:
        return self.dev.device_bytes

    def describe(self) -> dict:
        """Simulator view: each region's size, residency and whether its bytes are intact."""
        with self.lock:
            out = {}
            for r in self.regions.values():
                ok = None
                if r.resident:
                    ok = hashlib.sha256(self._path(r).read_bytes()).hexdigest() == r.sha256
                out[r.name] = {"bytes": r.size, "policy": r.policy, "resident": r.resident,
                               "offloaded": r.host is not None, "matches_fill": ok, "intact": r.intact}
            return {"simulated": True, "pid": self.dev.pid, "device_bytes": self.dev.device_bytes,
                    "context_bytes": self.context_bytes, "regions": out}

    def close(self) -> None:
        for r in self.regions.values():
            try:
                os.unlink(self._path(r))
            except FileNotFoundError:
                pass
        self.dev.close()
