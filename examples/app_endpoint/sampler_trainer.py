"""A vLLM-style sampler that sleeps between rollouts so a trainer fits on the same GPU.

    python examples/app_endpoint/sampler_trainer.py --rounds 3

The sampler is the SIMULATED inference server (``timeslice.testing.standin.server``,
vLLM flavour: ``/sleep?level=1``, ``/wake_up``, ``/is_sleeping``, over real
bytes on a simulated device); the trainer is this process, on the same device.
The device is too small for both, so each round the app-endpoint swapper
(``nodeagent.backends.app_endpoint``, what the node agent uses for a worker
registered with ``swap="vllm"``) puts the sampler to sleep — its weights go to
host memory, its KV cache is dropped — the trainer allocates and trains, frees,
and the sampler wakes with its weights back bit-exact. The swapper checks on
the device meter that the server really released and retook its memory.

With a cluster, a sampler job registers the same thing and the agent drives it:

    client.register_worker(pid=<engine pid>, node=..., swap="vllm",
                           endpoint="http://127.0.0.1:8000", tags={"weights": "offload"})
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request

from timeslice.common.device_errors import DeviceOutOfMemory
from timeslice.common.server import logs
from timeslice.common.server.records import WorkerValue
from timeslice.common.sim.device import SimDevice
from timeslice.nodeagent.backends.app_endpoint import make_app_swapper
from timeslice.nodeagent.sim.meter import SimMeter
from timeslice.sim.runtime import SimDeviceClient

MiB = 1 << 20


def start_sampler(sim_dir: str, weights: int, kv: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "timeslice.testing.standin.server", "--flavor", "vllm",
                             "--sim-dir", sim_dir, "--region", f"weights={weights}:offload",
                             "--region", f"kv_cache={kv}:discard"], stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def memory(url: str) -> dict:
    with urllib.request.urlopen(url + "/sim/memory", timeout=10) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    ap.add_argument("--device-mib", type=int, default=48, help="simulated device size (default: %(default)s)")
    ap.add_argument("--trainer-mib", type=int, default=32, help="default: %(default)s")
    a = ap.parse_args()
    logs.configure("example", "warning", json=False, stream=sys.stderr)   # stdout: the JSON result only
    with tempfile.TemporaryDirectory(prefix="ts-app-endpoint-") as sim_dir:
        dev = SimDevice(sim_dir, capacity_bytes=a.device_mib * MiB)
        server, ready = start_sampler(sim_dir, 20 * MiB, 16 * MiB)
        url = f"http://127.0.0.1:{ready['port']}"
        try:
            worker = WorkerValue(pid=ready["pid"], node="local", swap="vllm", endpoint=url,
                                 tags={"weights": "offload", "kv_cache": "discard"})
            sampler = make_app_swapper(worker, SimMeter(dev))
            trainer = SimDeviceClient.open(sim_dir)
            try:                                          # both at once: the device refuses
                trainer.alloc(a.trainer_mib * MiB)
                fits_beside = True
                trainer.free()
            except DeviceOutOfMemory:
                fits_beside = False
            rounds = []
            for r in range(a.rounds):
                assert memory(url)["regions"]["weights"]["resident"]        # sampling: weights on the device
                out = sampler.pause(None, deadline_s=30)                    # POST /sleep?level=1
                t0 = time.monotonic()
                trainer.alloc(a.trainer_mib * MiB)                          # the trainer's step fits now
                with trainer.compute() as mem:
                    mem[: 1 << 20] = bytes([r % 256]) * (1 << 20)
                trainer.free()
                back = sampler.resume(deadline_s=30)                        # POST /wake_up
                weights = memory(url)["regions"]["weights"]
                rounds.append({"freed_bytes": out.device_bytes, "back_bytes": back.device_bytes,
                               "trainer_s": round(time.monotonic() - t0, 3),
                               "weights_bit_exact": bool(weights["matches_fill"])})
            trainer.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
    ok = not fits_beside and all(r["weights_bit_exact"] and r["freed_bytes"] > 0 for r in rounds)
    print(json.dumps({"simulated": True, "trainer_fits_beside_awake_sampler": fits_beside, "rounds": rounds,
                      "ok": ok}, sort_keys=True), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
