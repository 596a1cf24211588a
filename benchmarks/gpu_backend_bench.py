"""Agent path vs direct driver calls, for checkpoint and restore of PyTorch workers on a real GPU.

    python benchmarks/gpu_backend_bench.py [--sizes-gib 1 8 32] [--parallel-gib 8] [--out FILE]

For each size a PyTorch worker (tests/nodeagent/torch_worker.py) fills that
many bytes of device memory; then, alternately:

* direct: ``cuCheckpointProcessLock`` + ``Checkpoint``, then ``Restore`` +
  ``Unlock``, back to back through the ctypes driver wrapper, nothing else;
* agent:  ``ops.snapshot_processes`` and ``ops.restore_processes`` with the
  driver backend: state query, NVML sizes, host/device admission, durable size
  record, the same four calls, result objects.

The agent should add no more than a few percent. Then two
workers of ``--parallel-gib`` each, both ways, in parallel threads. The
worker's data is verified by checksum after every cycle. Prints a table and
writes JSON (default ``benchmarks/results/gpu_backend_<date>.json``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timeslice.nodeagent.backends.cuda_driver import CudaDriver, CudaDriverBackend  # noqa: E402
from timeslice.nodeagent.backends.ops import restore_processes, snapshot_processes  # noqa: E402
from timeslice.nodeagent.backends.records import SnapshotRecords  # noqa: E402

GiB = 1 << 30
WORKER = ROOT / "tests" / "nodeagent" / "torch_worker.py"
LOCK_MS = 10_000


class Worker:
    def __init__(self, nbytes: int, seed: int):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--bytes", str(nbytes), "--seed", str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.q.put(x.strip()) for x in self.proc.stdout], daemon=True).start()
        tag, pid, self.checksum, _ = self.q.get(timeout=300).split()
        self.pid = int(pid)

    def verify(self) -> bool:
        self.proc.stdin.write("verify\n")
        self.proc.stdin.flush()
        return self.q.get(timeout=300) == f"VERIFY OK {self.checksum}"

    def stop(self) -> int | str:
        """Stop the worker; its exit code if it had died before (a worker lost mid-run), else "alive"."""
        died = self.proc.poll()
        self.proc.kill()
        self.proc.wait(60)
        return "alive" if died is None else died


def direct(drv: CudaDriver, pids: list[int]) -> tuple[float, float]:
    """(lock+checkpoint seconds, restore+unlock seconds) for all pids in parallel threads."""
    def down(pid):
        drv.lock(pid, LOCK_MS)
        drv.checkpoint(pid)

    def up(pid):
        drv.restore(pid)
        drv.unlock(pid)

    with ThreadPoolExecutor(len(pids)) as pool:
        t0 = time.perf_counter()
        list(pool.map(down, pids))
        t1 = time.perf_counter()
        list(pool.map(up, pids))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def agent(be: CudaDriverBackend, pids: list[int]) -> tuple[float, float, int, str]:
    t0 = time.perf_counter()
    snap = snapshot_processes(be, pids, lock_timeout_ms=LOCK_MS)
    t1 = time.perf_counter()
    if not snap.ok:
        return t1 - t0, float("nan"), 0, f"snapshot: {snap.error}"
    rest = restore_processes(be, pids)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, snap.bytes, "" if rest.ok else f"restore: {rest.error}"


def case(be: CudaDriverBackend, label: str, gib: float, nproc: int, reps: int) -> dict:
    workers = [Worker(int(gib * GiB), seed=i + 1) for i in range(nproc)]
    pids = [w.pid for w in workers]
    held = sum(be.device_bytes(p) or 0 for p in pids)
    runs = []
    exits: list = []
    try:
        for _ in range(reps):
            d_down, d_up = direct(be.driver, pids)
            ok_d = all(w.verify() for w in workers)
            a_down, a_up, moved, err = agent(be, pids)
            ok_a = all(w.verify() for w in workers)
            runs.append({"direct_checkpoint_s": d_down, "direct_restore_s": d_up, "agent_snapshot_s": a_down,
                         "agent_restore_s": a_up, "agent_bytes": moved, "error": err,
                         "verified_after_direct": ok_d, "verified_after_agent": ok_a})
    finally:
        exits = [w.stop() for w in workers]
    best = {k: min(r[k] for r in runs) for k in ("direct_checkpoint_s", "direct_restore_s",
                                                 "agent_snapshot_s", "agent_restore_s")}
    return {"case": label, "processes": nproc, "gib_each": gib, "device_bytes": held, "runs": runs, "best": best,
            "worker_exit_codes": exits, "failed": any(e != "alive" for e in exits) or not all(
                x["verified_after_direct"] and x["verified_after_agent"] and not x["error"] for x in runs),
            "checkpoint_overhead_pct": 100 * (best["agent_snapshot_s"] / best["direct_checkpoint_s"] - 1),
            "restore_overhead_pct": 100 * (best["agent_restore_s"] / best["direct_restore_s"] - 1),
            "direct_checkpoint_gbps": held / best["direct_checkpoint_s"] / 1e9,
            "direct_restore_gbps": held / best["direct_restore_s"] / 1e9}


def machine() -> dict:
    def sh(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return ""
    mem = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in open("/proc/meminfo") if ":" in ln}
    return {"gpu": sh("nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.current,"
                                    "pcie.link.width.current", "--format=csv,noheader"),
            "kernel": os.uname().release, "cpus": os.cpu_count(), "mem_total": mem.get("MemTotal"),
            "mem_available_at_start": mem.get("MemAvailable"), "python": sys.version.split()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 8, 32])
    ap.add_argument("--parallel-gib", type=float, default=8)
    ap.add_argument("--reps", type=int, default=2, help="cycles per size up to 8 GiB (larger sizes: 1)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"gpu_backend_{dt.date.today()}.json"))
    a = ap.parse_args()
    be = CudaDriverBackend(records=SnapshotRecords(tempfile.mkdtemp(prefix="ts-bench-records-")))
    info = {"machine": machine(), "driver_api_version": be.driver.version,
            "command": " ".join([Path(sys.executable).name] + sys.argv), "date": dt.datetime.now().isoformat()}
    plan = [(f"1 process, {g:g} GiB", g, 1, a.reps if g <= 8 else 1) for g in a.sizes_gib]
    if a.parallel_gib:
        plan.append((f"2 processes in parallel, {a.parallel_gib:g} GiB each", a.parallel_gib, 2, 1))
    results = []
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for label, gib, nproc, reps in plan:
        results.append(case(be, label, gib, nproc, reps))
        print(f"done: {label}: {json.dumps(results[-1]['best'])}", flush=True)
        # Written after every case, so a run cut short still leaves its figures.
        out.write_text(json.dumps({**info, "results": results}, indent=2))
    be.close()

    hdr = (f"{'case':<38} {'bytes':>8} | {'ckpt direct':>11} {'agent':>7} {'+%':>6} {'GB/s':>5} | "
           f"{'restore direct':>14} {'agent':>7} {'+%':>6} {'GB/s':>5} | ok")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        b = r["best"]
        if r["failed"]:
            print(f"{r['case']:<38} FAILED: worker exit codes {r['worker_exit_codes']}; "
                  + "; ".join(x["error"] or f"verified {x['verified_after_direct']}/{x['verified_after_agent']}"
                              for x in r["runs"]))
            continue
        verdict = "yes"
        print(f"{r['case']:<38} {r['device_bytes'] / 1e9:>7.2f}G | {b['direct_checkpoint_s']:>10.2f}s "
              f"{b['agent_snapshot_s']:>6.2f}s {r['checkpoint_overhead_pct']:>+5.1f}% "
              f"{r['direct_checkpoint_gbps']:>5.2f} | {b['direct_restore_s']:>13.2f}s {b['agent_restore_s']:>6.2f}s "
              f"{r['restore_overhead_pct']:>+5.1f}% {r['direct_restore_gbps']:>5.2f} | {verdict}")
    print(f"wrote {out}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
