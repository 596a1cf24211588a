"""On a real GPU: how fast can a job pin its host backup, and does pinning stall GPU work?

Every method reserves ``--gib`` GiB of page-locked host memory, fresh ("cold": pages never
touched by this process) and again after the same amount was freed ("warm": the kernel has
the pages at hand), and then checks that the buffer really is pinned by timing a
device-to-host copy into it (pageable memory copies at a fraction of the PCIe rate):

* ``torch_pin``: ``torch.empty(..., pin_memory=True)`` (the caching host allocator,
  cudaHostAlloc underneath: what ``pin_memory=True`` and torch-memory-saver's backup use);
* ``fault_register``: an anonymous mmap faulted in by ``--threads`` threads (memset in
  chunks, the GIL released by ctypes), then ``cudaHostRegister`` in ``--chunk-gib`` chunks;
* ``fault_register_thp``: the same with ``MADV_HUGEPAGE`` (transparent huge pages) first;
* ``shm_fallocate_register``: a file in /dev/shm reserved with ``posix_fallocate``,
  mapped shared, then registered in chunks (no separate fault pass);
* ``register_only``: registering memory that is already faulted in (what remains of the
  cost once the pages exist).

Then the stall test: a second *process* runs a steady stream of bf16 matrix products and
reports each one's time; this process pins ``--stall-gib`` GiB with ``torch_pin`` and with
the fastest method, and the other process's step times during the pinning are compared
with its step times before (ratio > 1: slowed). The same in *one* process (pinning in a
background thread while the main thread computes) for comparison with the ~100x stall
measured in round 2.

    python -m benchmarks.gpu_pin_probe --gib 16 --out $OUT
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

GIB = 1 << 30
_libc = ctypes.CDLL(None, use_errno=True)


def _cudart():
    import torch
    return torch.cuda.cudart()


def _register(addr: int, size: int, chunk: int) -> None:
    rt = _cudart()
    off = 0
    while off < size:
        n = min(chunk, size - off)
        err = rt.cudaHostRegister(addr + off, n, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with {err} at offset {off}")
        off += n


def _unregister(addr: int, size: int, chunk: int) -> None:
    rt = _cudart()
    off = 0
    while off < size:
        rt.cudaHostUnregister(addr + off)
        off += min(chunk, size - off)


def _fault(addr: int, size: int, threads: int) -> None:
    step = max(64 << 20, size // (threads * 4))
    spans = [(addr + o, min(step, size - o)) for o in range(0, size, step)]
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda s: ctypes.memset(s[0], 0, s[1]), spans))


_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MADV_HUGEPAGE = 14


def _map(size: int, fd: int = -1) -> int:
    flags = mmap.MAP_SHARED if fd >= 0 else (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = _libc.mmap(None, size, _PROT_RW, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(addr)


class Buffer:
    """A pinned host buffer made by one method; ``tensor`` views it for copies.

    Mapped with libc's mmap (not Python's mmap object) so that ``free`` really returns the
    memory: the probe allocates and frees many buffers of tens of GiB on one host."""

    def __init__(self, method: str, size: int, threads: int, chunk: int):
        import numpy as np
        import torch
        self.method, self.size, self.chunk = method, size, chunk
        self.fd = -1
        self.path = None
        self.addr = None
        self.registered = False
        if method == "torch_pin":
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            return
        if method == "shm_fallocate_register":
            fd, self.path = tempfile.mkstemp(prefix="pinprobe-", dir="/dev/shm")
            self.fd = fd
            os.posix_fallocate(fd, 0, size)
            self.addr = _map(size, fd)
        else:
            self.addr = _map(size)
            if method == "fault_register_thp":
                _libc.madvise(self.addr, size, _MADV_HUGEPAGE)
        if method in ("fault_register", "fault_register_thp"):
            _fault(self.addr, size, threads)
        _register(self.addr, size, chunk)
        self.registered = True
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(self.addr))
        self.tensor = torch.from_numpy(arr)

    def free(self) -> None:
        import gc

        import torch
        self.tensor = None
        gc.collect()
        if self.method == "torch_pin":
            torch._C._host_emptyCache()      # or torch's caching host allocator keeps it for the next caller
        if self.registered and self.addr is not None:
            _unregister(self.addr, self.size, self.chunk)
        if self.addr is not None:
            _libc.munmap(self.addr, self.size)
        if self.fd >= 0:
            os.close(self.fd)
        if self.path:
            os.unlink(self.path)


def copy_rate(host, dev, piece: int) -> dict:
    """One copy each way, in pieces that never cross a registration (a copy that spans two
    separately registered ranges fails with cudaErrorInvalidValue)."""
    import torch
    n = min(host.numel(), dev.numel())
    spans = [(o, min(piece, n - o)) for o in range(0, n, piece)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for o, k in spans:
        host[o:o + k].copy_(dev[o:o + k], non_blocking=True)
    torch.cuda.synchronize()
    d2h = n / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for o, k in spans:
        dev[o:o + k].copy_(host[o:o + k], non_blocking=True)
    torch.cuda.synchronize()
    h2d = n / (time.perf_counter() - t0) / 1e9
    return {"d2h_gb_s": round(d2h, 1), "h2d_gb_s": round(h2d, 1)}


def probe_methods(gib: float, threads: int, chunk: int, methods: list[str]) -> list[dict]:
    import torch
    size = int(gib * GIB)
    dev = torch.empty(min(size, 8 * GIB), dtype=torch.uint8, device="cuda")
    rows = []
    for method in methods:
        for temp in ("cold", "warm"):
            t0 = time.perf_counter()
            b = Buffer(method, size, threads, chunk)
            dt = time.perf_counter() - t0
            row = {"method": method, "memory": temp, "gib": gib, "seconds": round(dt, 3),
                   "gb_s": round(size / dt / 1e9, 2), **copy_rate(b.tensor, dev, chunk)}
            if method != "torch_pin" and temp == "warm":
                # what is left once the pages exist: unregister and register the same pages again
                _unregister(b.addr, size, chunk)
                t1 = time.perf_counter()
                _register(b.addr, size, chunk)
                row["register_only_s"] = round(time.perf_counter() - t1, 3)
            b.free()
            del b
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()      # or torch's caching host allocator hands the same block back
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


STEPPER = r"""
import sys, time, json, torch
n = int(sys.argv[1]); dur = float(sys.argv[2])
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5): a @ b
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + dur
while time.time() < end:
    t0 = time.time(); (a @ b); torch.cuda.synchronize(); t1 = time.time()
    print(json.dumps([t0, t1]), flush=True)
"""


def _steps_between(steps: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    return [t1 - t0 for t0, t1 in steps if t0 >= lo and t1 <= hi]


def stall_other_process(gib: float, threads: int, chunk: int, methods: list[str]) -> list[dict]:
    """Pin while another process computes; that process's step times during vs before."""
    size = int(gib * GIB)
    rows = []
    for method in methods:
        p = subprocess.Popen([sys.executable, "-c", STEPPER, "8192", "600"], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        steps: list[tuple[float, float]] = []

        def read(out=p.stdout, into=steps) -> None:
            for line in out:
                into.append(tuple(json.loads(line)))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(2.0)
        t_pin0 = time.time()
        b = Buffer(method, size, threads, chunk)
        t_pin1 = time.time()
        time.sleep(1.0)
        died = p.poll()                        # the other process must have lived through the pinning
        p.kill()
        p.wait()
        reader.join(2)
        b.free()
        before = _steps_between(steps, t_pin0 - 1.5, t_pin0)
        during = _steps_between(steps, t_pin0, t_pin1)
        row = {"method": method, "gib": gib, "pin_s": round(t_pin1 - t_pin0, 3),
               "other_step_before_ms": round(statistics.median(before) * 1e3, 3) if before else None,
               "other_step_during_ms": round(statistics.median(during) * 1e3, 3) if during else None,
               "other_steps_during": len(during), "other_exit": "alive" if died is None else died,
               "failed": died is not None}
        if before and during and died is None:
            row["other_slowdown_x"] = round(statistics.median(during) / statistics.median(before), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def stall_same_process(gib: float, threads: int, chunk: int, method: str) -> dict:
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        t0 = time.perf_counter()
        a @ bm
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    for _ in range(5):
        step()
    before = [step() for _ in range(20)]
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("b", Buffer(method, int(gib * GIB), threads, chunk)))
    t0 = time.perf_counter()
    th.start()
    during = []
    while th.is_alive():
        during.append(step())
    pin_s = time.perf_counter() - t0
    box["b"].free()
    row = {"method": method, "gib": gib, "pin_s": round(pin_s, 3),
           "step_before_ms": round(statistics.median(before) * 1e3, 3),
           "step_during_ms": round(statistics.median(during) * 1e3, 3) if during else None,
           "steps_during": len(during)}
    if during:
        row["slowdown_x"] = round(statistics.median(during) / statistics.median(before), 3)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--big-gib", type=float, default=40.0, help="one run of the fastest method at this size")
    ap.add_argument("--stall-gib", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--chunk-gib", type=float, default=64.0, help="cudaHostRegister chunk (one call per chunk)")
    ap.add_argument("--methods", default="torch_pin,fault_register,fault_register_thp,shm_fallocate_register")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import torch
    chunk = int(args.chunk_gib * GIB)
    methods = [m for m in args.methods.split(",") if m]
    rows = probe_methods(args.gib, args.threads, chunk, methods)
    fast = [r for r in rows if r["method"] != "torch_pin" and r["memory"] == "cold"]
    best = min(fast, key=lambda r: r["seconds"])["method"] if fast else "torch_pin"
    big = probe_methods(args.big_gib, args.threads, chunk, [best]) if args.big_gib > 0 else []
    other = stall_other_process(args.stall_gib, args.threads, chunk, ["torch_pin", best])
    same = [stall_same_process(args.stall_gib, args.threads, chunk, m) for m in ("torch_pin", best)]
    base = {(r["method"], r["memory"]): r for r in rows}
    torch_cold = base.get(("torch_pin", "cold"))
    for r in rows + big:
        if torch_cold:
            r["speedup_vs_torch_pin_cold"] = round(torch_cold["seconds"] / r["seconds"] * (r["gib"] / torch_cold["gib"]), 2)
    doc = {"command": "python -m benchmarks.gpu_pin_probe " + " ".join(argv if argv is not None else sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(0), "threads": args.threads, "chunk_gib": args.chunk_gib,
           "methods": rows, "big": big, "fastest": best, "stall_other_process": other,
           "stall_same_process": same}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_pin_probe.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("\nmethod                   memory  GiB   s      GB/s  d2h  h2d  x torch_pin")
    for r in rows + big:
        print(f"{r['method']:<24} {r['memory']:<6} {r['gib']:>4} {r['seconds']:>6} {r['gb_s']:>6} "
              f"{r['d2h_gb_s']:>4} {r['h2d_gb_s']:>4} {r.get('speedup_vs_torch_pin_cold', '')}")
    for r in other:
        if r["failed"]:
            print(f"other process while {r['method']} pins {r['gib']} GiB: FAILED (it exited {r['other_exit']})")
            continue
        print(f"other process while {r['method']} pins {r['gib']} GiB: x{r.get('other_slowdown_x')}")
    for r in same:
        print(f"same process while {r['method']} pins {r['gib']} GiB: x{r.get('slowdown_x')}")
    return 1 if any(r["failed"] for r in other) else 0


if __name__ == "__main__":
    sys.exit(main())
