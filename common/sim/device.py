"""SIMULATED GPUs: the node-wide "devices" shared by worker processes and the agent.

This is a simulator with honest semantics for machines without a GPU (CI,
laptops, the demo). It is never presented as a GPU. Its files, under the sim
dir (``TIMESLICE_SIM_DIR``, default ``/dev/shm/timeslice-sim``):

    ledger.json, ledger.lock   GPU count, capacity per GPU, bytes held per pid and on
                               which GPU (timeslice.common.sim.ledger)
    arena-<pid>                the process's "device memory": real bytes in a
                               shared-memory file that the worker maps
    devlock-<pid>              the process's device lock: the worker holds it
                               shared around every device operation; the agent
                               takes it exclusively to drain in-flight work
    state-<pid>.json           checkpoint state: running | locked | checkpointed,
                               with size and sha256 once checkpointed, and the GPU
                               the process is bound to (``gpu``)

and under the host dir (``TIMESLICE_SIM_HOST_DIR``, default ``<sim dir>/host``):

    host-<pid>                 the host copy of a checkpointed arena

State and host copies are files, not agent memory, so an agent restart never
forgets a snapshotted process (as the real driver keeps its host copy in the
process itself).

The device charges each process what a GPU does beyond what its program asked
for (``SimDeviceClient``, the worker's runtime, applies it): a *context* once it
holds anything (``TIMESLICE_SIM_CONTEXT_BYTES``; default the H200's 612 MiB per
process, scaled to the simulated capacity: 612 MiB of 143,771 MiB) and the
*allocator's slack* on every allocation (``TIMESLICE_SIM_ALLOCATOR_SLACK``, a
fraction; default 0.02: the H200 process with 44.0 GiB allocated held 45.16
GiB, 0.6 of it its context). The meter (the agent's NVML) sees the whole
holding, the allocator's figures only its own part, as on a GPU. Set in the
ledger by whoever creates it, like the capacity. Capacity *per GPU* comes from ``TIMESLICE_SIM_CAPACITY_BYTES``
(default ``DEFAULT_CAPACITY``) and the number of GPUs from ``TIMESLICE_SIM_GPUS``
(default 1) when the ledger is first created, or from whoever passes them
explicitly (the agent, a test harness). GPU ``k`` is named ``sim<k>`` (its
"UUID"); a worker binds to one GPU when it registers (``TIMESLICE_SIM_GPU`` or
``gpu=``, as a real worker picks its device) and holds all its bytes there.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from timeslice.common import procfs
from timeslice.common.files import atomic_write_json
from timeslice.common.sim.ledger import Ledger

ENV_SIM_DIR = "TIMESLICE_SIM_DIR"
ENV_SIM_HOST_DIR = "TIMESLICE_SIM_HOST_DIR"
ENV_SIM_CAPACITY = "TIMESLICE_SIM_CAPACITY_BYTES"
ENV_SIM_GPUS = "TIMESLICE_SIM_GPUS"
ENV_SIM_GPU = "TIMESLICE_SIM_GPU"          # worker side: the GPU this process binds to
ENV_SIM_CONTEXT = "TIMESLICE_SIM_CONTEXT_BYTES"      # the context each process is charged
ENV_SIM_SLACK = "TIMESLICE_SIM_ALLOCATOR_SLACK"      # the allocator's slack, a fraction of each allocation
H200_CONTEXT_SHARE = 612 / 143_771         # an H200 process's context (NVML, nothing allocated) of its GPU
DEFAULT_SLACK = 0.02
DEFAULT_CAPACITY = 4 << 30
MAX_GPUS = 64
DEVICE_ID = "sim0"


def device_id(gpu: int) -> str:
    """The simulated GPU's id (its "UUID"): ``sim<index>``."""
    return f"sim{gpu}"

RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"


def default_sim_dir() -> Path:
    env = os.environ.get(ENV_SIM_DIR)
    if env:
        return Path(env)
    # /dev/shm is RAM-backed, as device memory would be; fall back to the temp dir.
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "timeslice-sim"


class SimDevice:
    """Paths, ledger and per-pid state files of one simulated device."""

    def __init__(self, root: str | os.PathLike | None = None, host_dir: str | os.PathLike | None = None,
                 capacity_bytes: int | None = None, proc_root: str = procfs.PROC_ROOT, gpus: int | None = None,
                 context_bytes: int | None = None, slack: float | None = None):
        self.root = Path(root) if root else default_sim_dir()
        env_host = os.environ.get(ENV_SIM_HOST_DIR)
        self.host_dir = Path(host_dir) if host_dir else (Path(env_host) if env_host else self.root / "host")
        self.proc_root = proc_root
        self.root.mkdir(parents=True, exist_ok=True)
        self.host_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.root)
        env_cap, env_gpus = os.environ.get(ENV_SIM_CAPACITY), os.environ.get(ENV_SIM_GPUS)
        default_gpus = int(env_gpus) if env_gpus else 1
        for n in (gpus, default_gpus):
            if n is not None and not 1 <= n <= MAX_GPUS:
                raise ValueError(f"simulated GPU count must be 1..{MAX_GPUS}, got {n}")
        self.capacity, self.gpus = self.ledger.ensure(capacity_bytes, int(env_cap) if env_cap else DEFAULT_CAPACITY,
                                                      gpus, default_gpus)
        if (context_bytes is not None and context_bytes < 0) or (slack is not None and not 0 <= slack <= 1):
            raise ValueError("simulated context must be >= 0 bytes and the slack in [0, 1]")
        self.context_bytes, self.slack = self.ledger.ensure_model(context_bytes, slack, _model_defaults)

    def allocator_bytes(self, nbytes: int) -> int:
        """What the simulated allocator reserves for ``nbytes`` asked: the bytes plus its slack."""
        return nbytes + int(nbytes * self.slack + 0.999999) if nbytes > 0 else 0

    # -- paths ---------------------------------------------------------------
    def arena(self, pid: int) -> Path:
        return self.root / f"arena-{pid}"

    def devlock(self, pid: int) -> Path:
        return self.root / f"devlock-{pid}"

    def state_path(self, pid: int) -> Path:
        return self.root / f"state-{pid}.json"

    def host_copy(self, pid: int) -> Path:
        return self.host_dir / f"host-{pid}"

    # -- state files ---------------------------------------------------------
    def read_state(self, pid: int) -> dict | None:
        """The pid's state doc, or None if it never registered (or was reaped)."""
        try:
            return json.loads(self.state_path(pid).read_text())
        except FileNotFoundError:
            return None

    def write_state(self, pid: int, doc: dict) -> None:
        atomic_write_json(self.state_path(pid), doc)

    def register(self, pid: int, gpu: int = 0) -> dict:
        gpus = self.ledger.layout()[1]
        if not 0 <= gpu < gpus:
            raise ValueError(f"simulated GPU {gpu} does not exist (this node has {gpus}: 0..{gpus - 1})")
        doc = {"pid": pid, "start_time": procfs.start_time(pid, self.proc_root),
               "state": RUNNING, "bytes": 0, "sha256": None, "lost": False, "gpu": gpu}
        self.devlock(pid).touch()
        self.write_state(pid, doc)
        return doc

    # -- liveness ------------------------------------------------------------
    def is_dead(self, pid: int) -> bool:
        """Dead, or its pid now belongs to another process than the one that registered."""
        doc = self.read_state(pid)
        return not procfs.same_process(pid, doc.get("start_time") if doc else None, self.proc_root)

    def forget(self, pid: int) -> None:
        """Drop everything of ``pid`` (it exited): device bytes, host copy, files."""
        self.ledger.release(pid)
        for p in (self.arena(pid), self.host_copy(pid), self.devlock(pid), self.state_path(pid)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def reap(self) -> list[int]:
        """Forget every registered process that has exited. Returns their pids."""
        pids = {int(p.stem.split("-", 1)[1]) for p in self.root.glob("state-*.json")}
        pids |= set(self.ledger.snapshot()[1])
        dead = sorted(p for p in pids if self.is_dead(p))
        for p in dead:
            self.forget(p)
        return dead

    # -- sizes -----------------------------------------------------------------
    def held(self, pid: int) -> int:
        return self.ledger.snapshot()[1].get(pid, 0)

    def gpu_of(self, pid: int) -> int:
        doc = self.read_state(pid)
        return int(doc.get("gpu", 0)) if doc else 0

    def free_per_gpu(self) -> list[int]:
        """Free bytes of each GPU (holdings of dead processes count as free, as on a driver)."""
        cap, gpus, alloc = self.ledger.layout()
        free = [cap] * gpus
        for p, (g, v) in alloc.items():
            if g < gpus and not self.is_dead(p):
                free[g] -= v
        return free

    def free(self) -> int:
        """Free bytes over all GPUs."""
        return sum(self.free_per_gpu())


def _model_defaults(capacity: int) -> tuple[int, float]:
    """(context bytes, slack) where neither the creator nor the environment says: the H200's."""
    raw_ctx, raw_slack = os.environ.get(ENV_SIM_CONTEXT, "").strip(), os.environ.get(ENV_SIM_SLACK, "").strip()
    try:
        ctx = int(raw_ctx) if raw_ctx else int(capacity * H200_CONTEXT_SHARE)
        slack = float(raw_slack) if raw_slack else DEFAULT_SLACK
    except ValueError:
        raise ValueError(f"{ENV_SIM_CONTEXT}={raw_ctx!r} / {ENV_SIM_SLACK}={raw_slack!r}: not a number") from None
    if ctx < 0 or not 0 <= slack <= 1:
        raise ValueError(f"{ENV_SIM_CONTEXT} must be >= 0 and {ENV_SIM_SLACK} in [0, 1]")
    return ctx, slack
