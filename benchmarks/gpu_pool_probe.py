"""On a real GPU: the cooperative backup pool itself (TorchMemory(backup="pool")).

For each size (``--gib``, one child process per size so each starts cold):

* **first pin**: ``prepin`` of a pool for one offload region of that size (declared with
  ``host_bytes``), timed, with the method that worked; meanwhile another *process* runs
  bf16 matrix products, and its step times during the pinning are compared with before
  (``other_slowdown_x``: 1.0 = not slowed);
* **round trips** (``--trips``) of the dirty region: pause (copy out, release) and resume
  (map, copy in, verify), each timed; the weights' integer checksum checked after every resume;
* **clean**: ``mark_clean``, one pause that copies (the pool's copy predates the promise), then
  ``--trips`` clean pauses (no copy) and resumes, timed, bytes checked after each;
* **wrong claim**: the region is written while marked clean; the pause must catch it
  (``clean_mismatches`` 1), copy, and the resume bring back the written bytes;
* **checksum**: one full device checksum of the region alone, timed (``clean_parts``: the
  one-pass clean checksum a clean pause runs, and the full one, warm).

* **cold first touch** (``--compare-gib``, before anything else): two fresh ranges of that size
  mapped at once, one faulted in by ``madvise(MADV_POPULATE_WRITE)`` from 16 threads, the other by
  memset from 16 threads, each timed: on a freshly started machine the first touch of host memory is
  what bounds a first pin (16 GiB took 8.6 s there, 2 GB/s). Every run says whether it was the first
  on this boot (a marker in /dev/shm, which a reboot empties), the host's uptime and its free memory
  at the start: only a first call on a fresh machine measures the cold case.

    python -m benchmarks.gpu_pool_probe --gib 16,40 --out $OUT
    python -m benchmarks.gpu_pool_probe --gib 40 --compare-gib 20 --out $OUT     # cold: the first call
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

GIB = 1 << 30
CHUNK = 256 << 20                       # bytes per weight tensor, as gpu_rl_job.py

STEPPER = r"""
import sys, time, json, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(5): a @ b
torch.cuda.synchronize(); print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    t0 = time.time(); a @ b; torch.cuda.synchronize(); print(json.dumps([t0, time.time()]), flush=True)
"""


def _wsum(torch, ws) -> int:
    return int(sum(int(w.view(torch.int32).sum(dtype=torch.int64).item()) for w in ws))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 4)


def child(gib: float, trips: int) -> dict:
    import torch

    from timeslice.torch_memory import TorchMemory
    size = int(gib * GIB) // CHUNK * CHUNK
    mem = TorchMemory({"weights": "offload"}, backup="pool", host_bytes={"weights": size})
    row: dict = {"gib": gib, "backup": mem.backup, "bytes": size}
    # Another process computes while this one pins: is it slowed?
    other = subprocess.Popen([sys.executable, "-c", STEPPER, "120"], stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None and other.stdout.readline().strip() == "ready"
    steps: list[tuple[float, float]] = []

    def read(out=other.stdout):
        for line in out:
            steps.append(tuple(json.loads(line)))
    threading.Thread(target=read, daemon=True).start()
    time.sleep(2.0)
    t_a = time.time()
    row["first_pin_s"] = _timed(mem.prepin)
    t_b = time.time()
    time.sleep(0.5)
    died = other.poll()                          # the other process must have lived through the pinning
    other.kill()
    other.wait()
    before = [b - a for a, b in steps if t_a - 1.5 <= a and b <= t_a]
    during = [b - a for a, b in steps if a >= t_a and b <= t_b]
    row.update(pin_method=mem.host_pool.method, faulted_by=mem.host_pool.faulted_by,
               pin_gb_s=round(size / row["first_pin_s"] / 1e9, 2),
               host_bytes=mem.host_bytes(), other_steps_during=len(during),
               other_exit="alive" if died is None else died)
    if before and during and died is None:
        row["other_slowdown_x"] = round(statistics.median(during) / statistics.median(before), 3)

    gen = torch.Generator(device="cuda").manual_seed(1)
    with mem.region("weights"):
        ws = [torch.randn(CHUNK // 4, device="cuda", generator=gen) for _ in range(size // CHUNK)]
    torch.cuda.synchronize()
    want = _wsum(torch, ws)
    spans = mem.book.mover.spans("weights")
    row["spans"], row["span_bytes"] = len(spans), sum(n for _, n in spans)
    row["checksum_s"] = _timed(lambda: mem.book.mover.checksum(spans))

    def trip(kind: str) -> dict:
        p = _timed(lambda: mem.pause(["weights"]))
        r = _timed(lambda: mem.resume(["weights"]))
        return {"kind": kind, "pause_s": p, "resume_s": r, "round_trip_s": round(p + r, 4),
                "intact": _wsum(torch, ws) == want}

    row["dirty"] = [trip("dirty") for _ in range(trips)]
    mem.mark_clean("weights")
    row["first_clean"] = trip("first under the promise")
    row["clean"] = [trip("clean") for _ in range(trips)]
    # Where a clean pause goes: finding the spans, the clean checksum (warm); the rest is the release.
    mover = mem.book.mover
    row["clean_parts"] = {"spans_s": statistics.median(_timed(lambda: mover.spans("weights")) for _ in range(5)),
                          "checksum_s": statistics.median(_timed(lambda: mover.clean_checksum(spans))
                                                          for _ in range(5)),
                          "full_checksum_s": statistics.median(_timed(lambda: mover.checksum(spans))
                                                               for _ in range(5))}
    ws[0][:1024] += 1.0                          # written while promised clean
    torch.cuda.synchronize()
    want = _wsum(torch, ws)
    row["wrong_claim"] = trip("wrong claim")
    row["stats"] = mem.backup_stats()
    row["ok"] = (died is None
                 and all(t["intact"] for t in [*row["dirty"], row["first_clean"], *row["clean"], row["wrong_claim"]])
                 and row["stats"].get("clean_mismatches") == 1 and row["stats"].get("clean_skips") == trips)
    return row


MARKER = "/dev/shm/timeslice-pool-probe.ran"


def host_facts() -> dict:
    """Is this the first run on this boot, how long has the host been up, how much memory is free."""
    first = not os.path.exists(MARKER)
    try:
        open(MARKER, "a").close()
    except OSError:
        pass
    facts: dict = {"first_call_on_this_boot": first}
    try:
        facts["uptime_s"] = round(float(open("/proc/uptime").read().split()[0]), 1)
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ":" in ln}
        facts.update(mem_total_gib=round(mem["MemTotal"] / GIB, 1), mem_free_gib=round(mem["MemFree"] / GIB, 1),
                     mem_available_gib=round(mem.get("MemAvailable", 0) / GIB, 1))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return facts


def compare_fault(gib: float, threads: int = 16) -> dict:
    """Two fresh ranges, mapped at once (neither has touched memory yet), faulted in two ways."""
    import ctypes
    import mmap

    from timeslice import pinned as P
    n = int(gib * GIB) // P.HUGE * P.HUGE
    ranges = []
    for _ in range(2):
        addr = P._libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return {"error": "mmap failed"}
        if P.thp_available():
            P._libc.madvise(addr, n, P._MADV_HUGEPAGE)
        ranges.append(int(addr))
    out: dict = {"gib": gib, "threads": threads, "thp": P.thp_available()}
    try:
        t0 = time.perf_counter()
        how = P.fault_in(ranges[0], n, threads)
        out["populate_s" if how == "populate" else "populate_unavailable_memset_s"] = round(time.perf_counter() - t0, 3)
        P._populate_works[0] = False                # the same fault_in, the plain way
        t0 = time.perf_counter()
        P.fault_in(ranges[1], n, threads)
        out["memset_s"] = round(time.perf_counter() - t0, 3)
        for k in ("populate_s", "memset_s"):
            if k in out:
                out[k.replace("_s", "_gb_s")] = round(n / out[k] / 1e9, 2)
    finally:
        for a in ranges:
            P._libc.munmap(a, n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="16,40")
    ap.add_argument("--trips", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--compare-gib", type=float, default=0.0,
                    help="first: fault two fresh ranges of this size, by populate and by memset (0: skip)")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compare-child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare_child is not None:
        print("RESULT " + json.dumps(compare_fault(a.compare_child)), flush=True)
        return 0
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.child, a.trips)), flush=True)
        return 0                                 # a normal exit: TorchMemory detaches its regions (torch_release)
    facts = host_facts()
    print(json.dumps({"host": facts}), flush=True)
    cold = None
    if a.compare_gib > 0:
        p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pool_probe", "--compare-child", str(a.compare_gib)],
                           capture_output=True, text=True)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        cold = json.loads(got[-1][7:]) if got else {"error": p.stderr[-2000:]}
        print(json.dumps({"first_touch": cold}), flush=True)
    rows = []
    for g in [float(x) for x in a.gib.split(",") if x]:
        p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pool_probe", "--child", str(g), "--trips",
                            str(a.trips)], capture_output=True, text=True)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(got[-1][7:]) if got else {"gib": g, "ok": False, "error": p.stderr[-2000:]}
        row["child_exit_code"] = p.returncode
        if p.returncode != 0:
            row["ok"] = False
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"command": "python -m benchmarks.gpu_pool_probe " + " ".join(argv if argv is not None else sys.argv[1:]),
           "host": facts, "first_touch": cold, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_pool_probe.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'GiB':>4} {'method':>6} {'pin s':>6} {'GB/s':>5} {'other x':>7} {'cksum s':>7} "
          f"{'dirty trip':>10} {'clean pause':>11} {'clean trip':>10} ok")
    for r in rows:
        if "dirty" not in r or not r.get("ok"):
            print(f"{r['gib']:>4} FAILED (exit code {r.get('child_exit_code')}, other process {r.get('other_exit')}): "
                  f"{r.get('error', '')[-300:]}")
            continue
        print(f"{r['gib']:>4} {r['pin_method']:>6} {r['first_pin_s']:>6} {r['pin_gb_s']:>5} "
              f"{r.get('other_slowdown_x', '?'):>7} {r['checksum_s']:>7} "
              f"{statistics.median(t['round_trip_s'] for t in r['dirty']):>10} "
              f"{statistics.median(t['pause_s'] for t in r['clean']):>11} "
              f"{statistics.median(t['round_trip_s'] for t in r['clean']):>10} {r['ok']}")
    print(f"host: first call on this boot {facts['first_call_on_this_boot']}, up {facts.get('uptime_s')} s, "
          f"{facts.get('mem_free_gib')} of {facts.get('mem_total_gib')} GiB free at the start"
          + ("" if facts["first_call_on_this_boot"] else " (not cold: an earlier call touched host memory)"))
    if cold:
        print(f"first touch of {cold.get('gib')} GiB: populate {cold.get('populate_s', '-')} s "
              f"({cold.get('populate_gb_s', '-')} GB/s), memset {cold.get('memset_s', '-')} s "
              f"({cold.get('memset_gb_s', '-')} GB/s)")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
