"""SIMULATED GPU memory for a real JAX job on the CPU: its pytrees, really deleted on pause, accounted on the simulated device.

The CPU stand-in for ``timeslice.integrations.jax.JaxMemory``, so that a JAX
job can be time-sliced in CI, where there is no GPU. It is a simulator and says
so. It *is* a ``JaxMemory`` (the same puts, reads, pauses and resumes, the same
backup decisions over the same mover, ``JaxHostMover``, on JAX's CPU backend);
what it adds is the device the node agent and lockd plan from:

* the process's holding on the node's simulated device (the capacity ledger) is
  a small "context" plus every resident region, with what the device charges
  beyond them (``timeslice.common.sim.device``: its context and the allocator's
  slack), so capacity is enforced and
  swaps are planned as on a GPU; the live arrays outside the regions are what
  would stay behind on a GPU: reported (``left_behind``), not booked, since the
  simulated device's checkpoint of a parked process moves its context arena alone;
* the host backup is the simulated pool (``timeslice.sim.hostpool``: real host
  bytes, reserved at ``prepin``, reported while it is being reserved);
* a pause deletes the arrays, as on a GPU: a reference kept from before it
  raises JAX's "Array has been deleted", a read of the paused tag raises
  ``RegionReleased``. That is where the torch stand-in overwrites tensors with
  NaN: a CPU tensor cannot be taken away, a JAX array can, so here a phase run
  outside its hold fails at once instead of computing on poisoned bytes;
* copying device memory is device work: a pause or resume waits while the agent
  holds the process locked (``SimDeviceClient``); copies are paced to
  ``TIMESLICE_SIM_COOP_GBPS`` (``timeslice.sim.coop``; 0 = unthrottled);
* ``resume`` reserves the room on the ledger first (``DeviceOutOfMemory`` if it
  does not fit), then copies back and verifies.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

from timeslice.common.sim.device import device_id
from timeslice.integrations.jax import JaxMemory
from timeslice.jax_regions import JaxHostMover
from timeslice.sim.coop import DEFAULT_COOP_GBPS, ENV_COOP_GBPS
from timeslice.sim.hostpool import SimHostPool
from timeslice.sim.runtime import SimDeviceClient

DEFAULT_CONTEXT_BYTES = 256 << 10


class SimJaxMemory(JaxMemory):
    """SIMULATOR. ``JaxMemory`` on JAX's CPU backend, its device bytes booked on the simulated device."""

    def __init__(self, tags: Mapping[str, str] | None = None, sim_dir: str | os.PathLike | None = None, *,
                 context_bytes: int = DEFAULT_CONTEXT_BYTES, gpu: int | None = None, checksum: bool = True,
                 host_bytes: Mapping[str, int] | None = None, slab_bytes: int = 1 << 30, pin_gbps: float = 0.0,
                 pin_gate: str | None = None, gbps: float | None = None):
        raw = os.environ.get(ENV_COOP_GBPS)
        self.bps = (gbps if gbps is not None else float(raw) if raw else DEFAULT_COOP_GBPS) * 1e9
        self._sim = (slab_bytes, pin_gbps, pin_gate)
        self.context_bytes = int(context_bytes)
        self.dev = SimDeviceClient.open(sim_dir, gpu)
        self.dev.alloc(self.context_bytes)         # the "CUDA context": the process is on the device
        self._closed = False
        import jax
        super().__init__(tags, device=jax.devices("cpu")[0], backup="host", checksum=checksum,
                         host_bytes=host_bytes, allocator=None)

    def _backup_parts(self, pin_method: str, pin_threads: int | None):
        slab, gbps, gate = self._sim
        pool = SimHostPool(slab, gbps, gate, on_change=self._host_changed)
        return pool, JaxHostMover(self.jax, self._regions, pool, self._pace)

    def _pace(self, nbytes: int, t0: float) -> None:
        if self.bps > 0:
            ahead = nbytes / self.bps - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _device_work(self):
        return self.dev._device(None)              # waits while the agent holds the process locked

    def _allocator(self) -> int:
        """The simulated allocator's holding: the resident regions, with the device's slack on them."""
        with self._mu:
            resident = sum(r.nbytes() for t, r in self._regions.items() if t not in self._paused)
        return self.dev.dev.allocator_bytes(resident)

    def _account(self) -> None:
        """The context arena, then the resident regions (raises DeviceOutOfMemory if that does not fit;
        nothing changes then)."""
        if self._closed:
            return
        n = self._allocator()
        self.dev.hold(n)
        self._hold_peak = max(self._hold_peak, n)

    def device_id(self) -> str:
        return device_id(self.dev.gpu)

    def residue_bytes(self) -> int:
        """What this process holds on the simulated device outside its resident regions: the context."""
        resident = sum(r.nbytes() for t, r in self._regions.items() if t not in self._paused)
        return max(0, self.dev.device_bytes - resident)

    def peak_bytes(self) -> int:
        """The footprint with every region resident (as declared where it is not made yet)."""
        return self.context_bytes + self.planned_bytes()

    # -- DeviceStats (timeslice.memstats): the simulated allocator's figures and the meter's ----------
    def reset_peak(self) -> None:
        self._hold_peak = self._allocator()

    def allocator_bytes(self) -> int:
        return self._allocator()

    def allocator_peak_bytes(self) -> int:
        return max(self._hold_peak, self._allocator())

    def device_used_bytes(self) -> int | None:
        return self.dev.device_bytes

    def close(self) -> None:
        super().close()
        self._closed = True
        self.dev.close()
