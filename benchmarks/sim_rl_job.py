"""One synthetic RL job on the SIMULATED device: gpu_rl_job.py's phases and events, for dry runs on the CPU.

``python -m benchmarks.gpu_timeslice --dry-run`` runs the same orchestration and analysis as on a GPU
with this job in place of ``gpu_rl_job.py``: a dry run of the plumbing, not a measurement. Sizes are
the GPU job's with GiB read as MiB (--mem-gb 40: 40 MiB of weights). The job keeps its weights
resident on the simulated device (a ``SimCooperativeMemory`` region, or a ``SimDeviceClient`` arena
when swapped by checkpoint), checks their checksum at the start of every GPU phase, and holds its
activations as a real temporary (``scratch``: twice --scratch-gb, as the GPU job's x, w, a@b and tanh)
for the phase's length. A parked cooperative job keeps what the GPU job keeps outside its regions:
the device's context and ``--residue-gb`` more (the H200 job kept 1.78 GiB: 612 MiB of context, the
rest its allocator's and libraries'). A temporary that does not fit asks the node agent for room
(``timeslice.room``), as ``TorchMemory.with_room`` does on the GPU. Events: the same JSON lines
(``start``, ``pinned``, ``ready``, ``phase``, ``done``) ``gpu_timeslice.analyse`` reads.
"""
from __future__ import annotations

import argparse
import json
import os
import time

MiB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--mode", choices=["standalone", "sliced"], required=True)
    p.add_argument("--target", default="")
    p.add_argument("--group", default="gpu")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gen-s", type=float, default=1.5)
    p.add_argument("--reward-s", type=float, default=3.0)
    p.add_argument("--train-s", type=float, default=1.5)
    p.add_argument("--mem-gb", type=float, default=4.0, help="weights, in MiB here")
    p.add_argument("--scratch-gb", type=float, default=2.0, help="per-phase activations (twice this), MiB here")
    p.add_argument("--residue-gb", type=float, default=1.2, help="kept outside the regions when parked, MiB")
    p.add_argument("--release-cache", type=int, default=1)
    p.add_argument("--hint-bytes", type=int, default=0)
    p.add_argument("--swap", choices=["checkpoint", "cooperative"], default="checkpoint")
    p.add_argument("--backup", default="auto")
    p.add_argument("--clean-weights", action="store_true")
    p.add_argument("--sim-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = open(a.out, "a", buffering=1)

    def rec(**kw):
        kw.update(job=a.job, t=time.monotonic(), pid=os.getpid())
        out.write(json.dumps(kw) + "\n")

    rec(ev="start")
    from timeslice.sim.coop import SimCooperativeMemory
    from timeslice.sim.runtime import SimDeviceClient
    weights = int(a.mem_gb * MiB)
    scratch = max(1, int(2 * a.scratch_gb * MiB))
    client = None
    if a.mode == "sliced":
        from timeslice import OrchestratorClient
        client = OrchestratorClient(target=a.target, job_id=a.job, release_cache=bool(a.release_cache))
    coop = a.swap == "cooperative"
    memory = dev = None
    worker = None
    if coop:
        memory = SimCooperativeMemory({"weights": (weights, "offload")}, a.sim_dir, seed=sum(map(ord, a.job)),
                                      context_bytes=max(1, int(a.residue_gb * MiB)), resident=False)
        if client is not None:
            t0 = time.monotonic()
            worker = client.cooperate(memory)          # channel, registration, pinned pool: outside every hold
            rec(ev="pinned", start=t0, end=time.monotonic(), host_bytes=memory.host_bytes(), method="sim",
                backup="pool")
    else:
        dev = SimDeviceClient.open(a.sim_dir)
    expected = ""

    def checksum() -> str:
        return memory.checksum("weights") if memory is not None else dev.checksum()  # type: ignore[union-attr]

    def load_weights() -> None:
        nonlocal expected
        t0 = time.monotonic()
        if memory is not None:
            memory.allocate()
            if a.clean_weights:
                memory.mark_clean("weights")
        else:
            dev.alloc(weights)                                                          # type: ignore[union-attr]
            if client is not None:
                client.register_worker(device_bytes=dev.device_bytes)                  # type: ignore[union-attr]
        expected = checksum()
        rec(ev="ready", weights_bytes=weights, checksum=expected, register_s=time.monotonic() - t0, swap=a.swap,
            backup="pool" if coop else "")

    final: dict = {}

    def work(seconds: float) -> int:
        """The phase's device work: its activations held while it runs, the weights read."""
        n, t0 = 0, time.monotonic()
        if memory is not None:
            with memory.scratch(scratch):
                while time.monotonic() - t0 < seconds:
                    with memory.compute("weights") as w:
                        _ = w[n % max(1, weights - 4096):][:4096].tobytes()
                    n += 1
                    time.sleep(0.01)
            return n
        assert dev is not None
        dev.hold(dev.dev.allocator_bytes(scratch))
        try:
            while time.monotonic() - t0 < seconds:
                with dev.compute() as w:
                    _ = w[:4096].tobytes()
                n += 1
                time.sleep(0.01)
        finally:
            dev.hold(0)
        return n

    def gpu_phase(name: str, seconds: float, last: bool = False) -> None:
        ctx = client.on_accelerators(a.group, device_bytes_hint=a.hint_bytes) if client else _Null()
        t_req = time.monotonic()
        with ctx as grant:
            t0 = time.monotonic()
            if not expected:
                load_weights()
            ok = checksum() == expected
            n = work(seconds)
            if last:
                final["checksum_ok"] = checksum() == expected
            t1 = time.monotonic()
            rec(ev="phase", phase=name, gpu=True, t_req=t_req, start=t0, end=t1, gpu_spans=[[t0, t1]], matmuls=n,
                checksum_ok=ok, token=getattr(grant, "token", 0), restored=getattr(grant, "restored", False),
                elided=getattr(grant, "elided", False), bytes_moved=getattr(grant, "bytes_moved", 0),
                waited_ms=getattr(grant, "waited_ms", 0.0),
                room_asks=getattr(memory, "room_asks", 0))
            if not ok:
                raise SystemExit(f"{a.job}: weights corrupted after restore")

    t_start = time.monotonic()
    for i in range(a.iters):
        gpu_phase("generate", a.gen_s)
        t0 = time.monotonic()
        time.sleep(a.reward_s)
        rec(ev="phase", phase="rewards", gpu=False, start=t0, end=time.monotonic())
        gpu_phase("train", a.train_s, last=i == a.iters - 1)
    m = client.measured(a.group) if client is not None else None
    rec(ev="done", wall=time.monotonic() - t_start, checksum_ok=final.get("checksum_ok", False),
        backup_stats=memory.backup_stats() if memory is not None else {},
        measured={"peak": m.peak_bytes, "context": m.context_bytes} if m is not None else {},
        residues=list(worker.residues) if worker is not None else [])
    if client is not None:
        client.close()
    out.close()
    return 0


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
