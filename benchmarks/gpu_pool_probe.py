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

    python -m benchmarks.gpu_pool_probe --gib 16,40 --out $OUT
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
    row.update(pin_method=mem.host_pool.method, pin_gb_s=round(size / row["first_pin_s"] / 1e9, 2),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="16,40")
    ap.add_argument("--trips", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.child, a.trips)), flush=True)
        os._exit(0)                              # tms 0.0.10 can fail a free at teardown; the result is out
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
           "rows": rows}
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
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
