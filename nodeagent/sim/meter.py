"""``SimMeter``: the agent's device meter over the SIMULATED GPUs (``timeslice.common.sim.device``)."""
from __future__ import annotations

from timeslice.common.sim.device import CHECKPOINTED, SimDevice, device_id


class SimMeter:
    """``DeviceMeter`` over the simulated devices (``sim0`` .. ``sim<N-1>``)."""

    def __init__(self, dev: SimDevice):
        self.dev = dev

    def usage(self, pid: int) -> dict[str, int] | None:
        """Bytes on the process's GPU while it has a context there (running or locked,
        even with nothing allocated); {} if it never registered or is checkpointed."""
        doc = self.dev.read_state(pid)
        if doc is None or doc["state"] == CHECKPOINTED:
            return {}
        return {device_id(int(doc.get("gpu", 0))): self.dev.held(pid)}

    def processes(self) -> dict[int, dict[str, int]]:
        """Every live process holding simulated device memory -> its bytes per GPU."""
        _, _, alloc = self.dev.ledger.layout()
        return {p: {device_id(g): n} for p, (g, n) in alloc.items() if n > 0 and not self.dev.is_dead(p)}

    def free(self) -> dict[str, int] | None:
        return {device_id(g): n for g, n in enumerate(self.dev.free_per_gpu())}
