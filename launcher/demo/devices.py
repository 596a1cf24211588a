"""The demo's "GPU work": real bytes on the SIMULATED device, or real PyTorch on a CUDA GPU.

Both offer the same four calls to the job loop:

    gpu.allocate()          # first GPU phase only: take the job's device memory and fill it
    gpu.work(seconds)       # compute on the device memory for that long
    gpu.verify() -> bool    # the device memory is exactly what this job last wrote
    gpu.nbytes              # the job's footprint

``SimGpu`` is a simulator (``timeslice.common.sim``): the job's "weights" are real
bytes in a bounded shared-memory arena that the node agent can snapshot to
host memory and restore. ``work`` rewrites them block by block (a byte
permutation: cheap, reversible, and it changes every byte), keeping a CRC per
block, so ``verify`` after a restore checks every byte that came back.
``TorchGpu`` keeps a float32 weight tensor of the same footprint on the GPU and
runs matmuls; ``verify`` compares its sum with the one recorded at the last yield.
"""
from __future__ import annotations

import random
import time
import zlib
from typing import Any

BLOCK = 4 << 20                                       # bytes rewritten per step
CUDA_CONTEXT_BYTES = 1 << 30                          # allowance for a CUDA context in a job's hint
_STEP = bytes((5 * i + 1) % 256 for i in range(256))  # a permutation of the byte values


class SimGpu:
    kind = "sim"

    def __init__(self, sim_dir: str, nbytes: int, seed: int):
        from timeslice.sim.runtime import SimDeviceClient
        self.dev = SimDeviceClient.open(sim_dir)     # registers this process on the device
        self.nbytes = int(nbytes)
        self.hint_bytes = self.nbytes                # what the job will hold: device_bytes_hint
        self.seed = seed
        self.crcs: list[int] = []
        self.allocated = False
        self._next = 0

    def _blocks(self):
        for off in range(0, self.nbytes, BLOCK):
            yield off, min(BLOCK, self.nbytes - off)

    def allocate(self) -> None:
        self.dev.alloc(self.nbytes)
        base = random.Random(self.seed).randbytes(BLOCK)
        with self.dev.compute() as mem:
            for i, (off, n) in enumerate(self._blocks()):
                r = (i * 97) % BLOCK
                blk = (base[r:] + base[:r])[:n]
                mem[off:off + n] = blk
                self.crcs.append(zlib.crc32(blk))
        self.allocated = True

    def work(self, seconds: float) -> int:
        """Rewrite blocks, round robin, until ``seconds`` have passed; returns the steps done."""
        deadline = time.monotonic() + seconds
        blocks = list(self._blocks())
        steps = 0
        while time.monotonic() < deadline:
            i = self._next % len(blocks)
            off, n = blocks[i]
            with self._view() as mem:                       # a "kernel" on device memory
                new = bytes(mem[off:off + n]).translate(_STEP)
                mem[off:off + n] = new
            self.crcs[i] = zlib.crc32(new)
            self._next += 1
            steps += 1
        return steps

    def verify(self) -> bool:
        with self._view() as mem:
            return all(zlib.crc32(mem[off:off + n]) == self.crcs[i] for i, (off, n) in enumerate(self._blocks()))

    def _view(self):
        """The device memory, inside a device operation (blocks while the agent holds the process)."""
        return self.dev.compute()

    def free(self) -> None:
        self.dev.free()
        self.allocated = False

    def device_free(self) -> int | None:
        """Free bytes of the whole (simulated) device right now, as the agent would measure them."""
        return self.dev.dev.free()

    def describe(self) -> str:
        return "SIMULATED device"


class SimCoopGpu(SimGpu):
    """SIMULATED device memory that the job moves itself (a cooperative region, ``timeslice.sim.coop``).

    The same job as ``SimGpu`` (seeded blocks, rewritten round robin, checked
    by CRC), but its bytes live in one ``offload`` region of a
    ``SimCooperativeMemory``: when another job needs the device, the agent asks
    this process to copy them to its retained host backup and release them,
    instead of checkpointing the whole process.
    """

    kind = "sim-cooperative"
    CONTEXT = 1 << 20

    def __init__(self, sim_dir: str, nbytes: int, seed: int):
        self.sim_dir = sim_dir
        self.nbytes = int(nbytes)
        self.hint_bytes = self.nbytes
        self.seed = seed
        self.crcs: list[int] = []
        self.allocated = False
        self._next = 0
        self.memory: Any = None      # a SimCooperativeMemory once allocated

    def _blocks(self):
        n = self.nbytes - self.CONTEXT
        for off in range(0, n, BLOCK):
            yield off, min(BLOCK, n - off)

    def allocate(self) -> None:
        from timeslice.sim.coop import SimCooperativeMemory
        memory = SimCooperativeMemory({"weights": (self.nbytes - self.CONTEXT, "offload")}, self.sim_dir,
                                      seed=self.seed, context_bytes=self.CONTEXT)
        self.memory, self.dev = memory, memory.dev
        with memory.compute("weights") as mem:
            self.crcs = [zlib.crc32(mem[off:off + n]) for off, n in self._blocks()]
        self.allocated = True

    def _view(self):
        return self.memory.compute("weights")

    def free(self) -> None:
        if self.memory is not None:
            self.memory.close()
        self.allocated = False

    def describe(self) -> str:
        return "SIMULATED device, cooperative regions"


class TorchGpu:
    kind = "cuda"

    def __init__(self, nbytes: int, seed: int):
        import torch
        self.torch = torch
        self.nbytes = int(nbytes)
        # The job's footprint is its tensors plus the CUDA context (with cuBLAS's
        # workspace about 0.8 GB on an H200): lockd must make room for both.
        self.hint_bytes = self.nbytes + CUDA_CONTEXT_BYTES
        self.seed = seed
        self.allocated = False
        self.w: Any = None           # torch tensors once allocated (torch is imported lazily)
        self.a: Any = None
        self.checksum: float | None = None

    def allocate(self) -> None:
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(self.seed)
        self.w = torch.rand(self.nbytes // 4, device="cuda", generator=g)     # the job's "weights"
        self.a = torch.rand(2048, 2048, device="cuda", generator=g)
        torch.cuda.synchronize()
        self.checksum = self._sum()
        self.allocated = True

    def _sum(self) -> float:
        # In float64, chunk by chunk: a float64 copy of all the weights would need twice
        # their memory, which a GPU shared this tightly does not have.
        chunk = 8 << 20
        return float(sum(self.w[i:i + chunk].double().sum().item() for i in range(0, self.w.numel(), chunk)))

    def work(self, seconds: float) -> int:
        torch = self.torch
        deadline = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < deadline:
            self.a = torch.tanh(self.a @ self.a * (1.0 / 2048))
            self.w.mul_(0.999).add_(0.001)
            torch.cuda.synchronize()                        # nothing in flight when we yield
            steps += 1
        self.checksum = self._sum()
        return steps

    def verify(self) -> bool:
        return self.checksum is None or abs(self._sum() - self.checksum) <= 1e-9 * max(1.0, abs(self.checksum))

    def device_free(self) -> int | None:
        return None            # the agent reads NVML; the caller falls back to total - our bytes

    def free(self) -> None:
        self.w = self.a = None
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        self.allocated = False

    def describe(self) -> str:
        return f"CUDA GPU ({self.torch.cuda.get_device_name(0)})"


def torch_cuda_available() -> bool:
    """True if torch imports and sees a CUDA device (checked in a way that creates no context)."""
    try:
        import torch
    except Exception:  # torch missing or broken: no GPU path
        return False
    try:
        return torch.cuda.device_count() > 0
    except Exception:
        return False
