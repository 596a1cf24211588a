"""One synthetic RL job on a real GPU (PyTorch): generate → rewards (CPU) → train, looped.

Used by benchmarks/gpu_timeslice.py. In --mode sliced, the two GPU phases run
inside ``orchestrator.on_accelerators(group)``; in --mode standalone, without
any lock. The job keeps ``--mem-gb`` of "weights" resident on the GPU, filled
from a seed, and verifies their checksum at the start of every GPU phase — so
a snapshot/restore that corrupted or lost device memory is caught. Every phase
is written as a JSON line (monotonic time, token, restored/elided/bytes).

Cooperative (``--swap cooperative``): with ``--backup pool`` (or ``auto`` where it
works) the job declares its weights' size and cooperates *before* its first
acquire, so its pinned backup is reserved outside every hold (``ev: pinned``);
with ``--backup tms`` it cooperates inside its first hold, as torch-memory-saver's
own backup needs device work, and that pinning is recorded as not-GPU time of
that phase (``gpu_spans``). ``--clean-weights`` promises the weights are not
written after loading (a sampler between weight syncs): the pause after the
first copies them out, later pauses do not. A cooperative job's phase runs through
``TorchMemory.with_room``: an allocation that does not fit inside its hold asks the node agent to
move parked residue off the GPU and the phase's work runs again (``timeslice.room``). The ``done``
event carries what the client measured of its holds (peak, context) and its residue after each pause.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def checksum(ts: list[torch.Tensor]) -> int:
    # Integer sum of the raw 32-bit words: exact, order independent, on the GPU.
    return int(sum(int(t.view(torch.int32).sum(dtype=torch.int64).item()) for t in ts))


def busy(seconds: float, a: torch.Tensor, b: torch.Tensor) -> int:
    """Matmuls until ``seconds`` of GPU work have run; returns how many."""
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(4):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        n += 4
    return n


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
    p.add_argument("--mem-gb", type=float, default=4.0)
    p.add_argument("--scratch-gb", type=float, default=2.0, help="per-phase activations, freed after")
    p.add_argument("--release-cache", type=int, default=1)
    p.add_argument("--hint-bytes", type=int, default=0, help="peak device footprint, for swap elision")
    p.add_argument("--swap", choices=["checkpoint", "cooperative"], default="checkpoint",
                   help="cooperative: weights in a torch-memory-saver region the job pauses itself")
    p.add_argument("--backup", choices=["auto", "pool", "tms"], default="auto",
                   help="cooperative: our pinned pool (copied by us) or torch-memory-saver's own backup")
    p.add_argument("--clean-weights", action="store_true",
                   help="cooperative: mark the weights clean once loaded (copied out at the first pause only)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = open(a.out, "a", buffering=1)

    def rec(**kw):
        kw.update(job=a.job, t=time.monotonic(), pid=os.getpid())
        out.write(json.dumps(kw) + "\n")

    rec(ev="start")                                  # the job's wall clock starts here (torch imported)

    dev = torch.device("cuda")
    chunk = 256 * 1024 * 1024 // 4                     # 256 MiB of float32 per tensor
    weights: list[torch.Tensor] = []
    expected = 0
    client = None
    if a.mode == "sliced":
        from timeslice import OrchestratorClient
        client = OrchestratorClient(target=a.target, job_id=a.job, release_cache=bool(a.release_cache))

    memory = None
    worker = None
    n_chunks = max(1, int(a.mem_gb * 4))
    early = False                                    # cooperate before the first acquire (pool backup)
    if a.swap == "cooperative":
        from timeslice.torch_memory import TorchMemory
        memory = TorchMemory({"weights": "offload"}, backup=a.backup,
                             host_bytes={"weights": n_chunks * chunk * 4})
        early = memory.backup == "pool"
        if early and client is not None:
            t0 = time.monotonic()
            worker = client.cooperate(memory)        # channel, registration, pinned pool: outside every hold
            rec(ev="pinned", start=t0, end=time.monotonic(), host_bytes=memory.host_bytes(),
                method=memory.host_pool.method, backup=memory.backup)
    pin_inside: list[float] = []                     # [start, end] of pinning inside a hold (tms backup)

    def load_weights() -> None:
        # Like a real job, the model goes onto the GPU inside the first GPU phase
        # (while holding the group). A job that cooperated already (pool backup)
        # tells the agent its region's size as the region grows; the others
        # register now that they own device memory, so the agent knows what to move.
        nonlocal expected, worker
        gen = torch.Generator(device=dev).manual_seed(sum(map(ord, a.job)))
        if memory is not None:
            with memory.region("weights"):
                weights.extend(torch.randn(chunk, device=dev, generator=gen) for _ in range(n_chunks))
            if a.clean_weights:
                memory.mark_clean("weights")     # not written from here on: later pauses copy nothing
        else:
            weights.extend(torch.randn(chunk, device=dev, generator=gen) for _ in range(n_chunks))
        expected = checksum(weights)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        if client is not None and memory is not None and not early:
            worker = client.cooperate(memory)   # channel + registration; tms pins its backup now (we hold)
            pin_inside[:] = [t0, time.monotonic()]
        elif client is not None and memory is None:
            client.register_worker(device_bytes=torch.cuda.memory_reserved())
        rec(ev="ready", weights_bytes=sum(w.numel() * 4 for w in weights), checksum=expected,
            register_s=time.monotonic() - t0, swap=a.swap, backup=getattr(memory, "backup", ""))

    side = int((a.scratch_gb * 2**30 / 2 / 2) ** 0.5) // 64 * 64   # two bf16 square matrices

    final = {}

    def gpu_phase(name: str, seconds: float, last: bool = False) -> None:
        ctx = client.on_accelerators(a.group, device_bytes_hint=a.hint_bytes) if client else _Null()
        t_req = time.monotonic()
        with ctx as grant:
            t0 = time.monotonic()
            if not weights:
                load_weights()
            ok = checksum(weights) == expected

            def work() -> int:
                x = torch.randn(side, side, device=dev, dtype=torch.bfloat16)
                w = torch.randn(side, side, device=dev, dtype=torch.bfloat16) / side ** 0.5
                return busy(seconds, x, w)
            # An allocation that does not fit asks for room (parked residue moved off) and runs again.
            n = memory.with_room(work) if memory is not None and client is not None else work()
            if last:
                # The job's last look at its weights happens while it still holds the GPU: after
                # its last yield it may be parked, and a parked process must not touch the device.
                final["checksum_ok"] = checksum(weights) == expected
            t1 = time.monotonic()
            # GPU time excludes pinning done inside the hold (tms backup's first phase): it is host work.
            spans = [[t0, pin_inside[0]], [pin_inside[1], t1]] if pin_inside and t0 <= pin_inside[0] else [[t0, t1]]
            pin_inside.clear()
            rec(ev="phase", phase=name, gpu=True, t_req=t_req, start=t0, end=t1, gpu_spans=spans, matmuls=n,
                checksum_ok=ok,
                token=getattr(grant, "token", 0), restored=getattr(grant, "restored", False),
                elided=getattr(grant, "elided", False), bytes_moved=getattr(grant, "bytes_moved", 0),
                waited_ms=getattr(grant, "waited_ms", 0.0), reserved=torch.cuda.memory_reserved(),
                room_asks=getattr(memory, "room_asks", 0))
            if not ok:
                raise SystemExit(f"{a.job}: weights corrupted after restore")
            if client is None and a.release_cache:
                torch.cuda.empty_cache()

    t_start = time.monotonic()
    for i in range(a.iters):
        gpu_phase("generate", a.gen_s)
        t0 = time.monotonic()
        time.sleep(a.reward_s)                        # rewards: CPU only, GPU untouched
        rec(ev="phase", phase="rewards", gpu=False, start=t0, end=time.monotonic())
        gpu_phase("train", a.train_s, last=i == a.iters - 1)
    m = client.measured(a.group) if client is not None else None
    rec(ev="done", wall=time.monotonic() - t_start, checksum_ok=final.get("checksum_ok", False),
        backup_stats=memory.backup_stats() if memory is not None else {},
        measured={"peak": m.peak_bytes, "context": m.context_bytes} if m is not None else {},
        residues=list(worker.residues) if worker is not None else [])
    if client is not None:
        client.close()
    if memory is not None:
        # torch-memory-saver 0.0.10 can fail an allocator free during interpreter teardown ("only
        # support interesting region", exit code 1) after everything is done; the results are written.
        out.close()
        os._exit(0)
    return 0


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
