"""On a real GPU: where a clean region's round trip goes, part by part, and checksum candidates.

One child process (cold), one offload region of ``--gib`` in 256 MiB tensors, the pinned pool:

* **clean trips** (``--trips``), each part timed on its own: finding the spans, the device
  checksum, torch-memory-saver's release (``pause``: unmap and free), its map (``resume``),
  finding the spans again, the copy in with its overlapped verify; the bytes checked after each;
* **floors**: the same host pieces copied into a plain device buffer of the same size (no
  torch-memory-saver, nothing to map): the link alone, both ways;
* **driver**: ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` and ``cuMemUnmap`` +
  ``cuMemRelease`` of as many allocations of the same size, timed (ctypes on libcuda: what
  torch-memory-saver does per allocation);
* **checksums**: each candidate over the region's spans, timed (median of 5), and whether it
  notices one changed byte and two swapped 8-byte words.

    python -m benchmarks.gpu_swap_parts --gib 16 --trips 3 --out $OUT
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
CHUNK = 256 << 20


def _t(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return round(time.perf_counter() - t0, 5), out


def _driver(n: int, size: int) -> dict:
    """What torch-memory-saver does per allocation, timed through libcuda itself."""
    cu = ctypes.CDLL("libcuda.so.1")

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Props(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                    ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]

    class Access(ctypes.Structure):
        _fields_ = [("location", Loc), ("flags", ctypes.c_int)]
    props = Props(type=1, requestedHandleTypes=0, location=Loc(type=1, id=0))   # pinned, device 0
    acc = Access(location=Loc(type=1, id=0), flags=3)                            # read-write
    ptrs, handles = [], []
    for _ in range(n):
        p = ctypes.c_uint64()
        assert cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                      ctypes.c_uint64(0), ctypes.c_uint64(0)) == 0
        ptrs.append(p.value)
    out: dict = {}
    for rep in range(2):
        t0 = time.perf_counter()
        for _p in ptrs:
            h = ctypes.c_uint64()
            assert cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(props), ctypes.c_uint64(0)) == 0
            handles.append(h.value)
        t1 = time.perf_counter()
        for p, h in zip(ptrs, handles):
            assert cu.cuMemMap(ctypes.c_uint64(p), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(h),
                               ctypes.c_uint64(0)) == 0
        t2 = time.perf_counter()
        for p in ptrs:
            assert cu.cuMemSetAccess(ctypes.c_uint64(p), ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)) == 0
        t3 = time.perf_counter()
        for p in ptrs:
            assert cu.cuMemUnmap(ctypes.c_uint64(p), ctypes.c_size_t(size)) == 0
        t4 = time.perf_counter()
        for h in handles:
            assert cu.cuMemRelease(ctypes.c_uint64(h)) == 0
        t5 = time.perf_counter()
        handles.clear()
        out[f"rep{rep}"] = {k: round(v, 5) for k, v in dict(create_s=t1 - t0, map_s=t2 - t1, access_s=t3 - t2,
                                                            unmap_s=t4 - t3, release_s=t5 - t4).items()}
    return out


def _checksums(torch, mover, spans) -> dict:
    dev = mover._dev

    w = {k: torch.randint(1, 127, (k, 8), dtype=torch.int8, device="cuda") for k in (4096, 16384)}

    def int_mm(k: int, col_major: bool):
        b = w[k].t().contiguous().t() if col_major else w[k]

        def run():
            parts = [torch._int_mm(dev(a, n).view(torch.int8).view(-1, k), b).sum(0, dtype=torch.int64)
                     for a, n in spans]
            return repr(torch.stack(parts).tolist())
        return run

    def int_mm_rows(k: int):
        b = w[k].t().contiguous().t()

        def run():
            outs = [torch._int_mm(dev(a, n).view(torch.int8).view(-1, k), b) for a, n in spans]
            o = torch.cat(outs).to(torch.int64)
            i = torch.arange(o.shape[0], device=o.device).unsqueeze(1)
            return repr(torch.stack([o.sum(0), (o * i).sum(0)]).tolist())
        return run

    cands = {"sums2 (today)": lambda: mover.checksum(spans),
             "rows only": lambda: _rows(torch, dev, spans, 1 << 16),
             "rows 512 words": lambda: mover.clean_checksum(spans),
             "rows 4096 words": lambda: _rows(torch, dev, spans, 4096), "int_mm k4096": int_mm(4096, False),
             "int_mm k4096 colmajor": int_mm(4096, True), "int_mm k16384 colmajor": int_mm(16384, True),
             "int_mm_rows k16384": int_mm_rows(16384)}
    a0, n0 = spans[len(spans) // 2]
    probe = dev(a0, n0).view(torch.int64)
    out = {}
    for name, fn in cands.items():
        try:
            base = fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t, _ = _t(lambda fn=fn: (fn(), torch.cuda.synchronize()))
                times.append(t)
            b = probe.view(torch.uint8)
            b[12345] += 1
            flip = fn() != base
            b[12345] -= 1
            x, y = probe[100].clone(), probe[101].clone()
            probe[100], probe[101] = y, x
            swap = fn() != base
            probe[100], probe[101] = x, y
            assert fn() == base
            out[name] = {"s": statistics.median(times), "flip": flip, "swap": swap}
        except Exception as e:                      # a candidate that does not run here says why
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def _rows(torch, dev, spans, words: int) -> str:
    parts = [dev(a, n).view(torch.int64).view(-1, words).sum(1) for a, n in spans]
    r = torch.cat(parts)
    i = torch.arange(r.numel(), device=r.device)
    return repr(torch.stack([r.sum(), (r * i).sum()]).tolist())


def _copies(torch, mem, tms, mover, spans, pieces, plain) -> dict:
    """Copy-in variants: is it the checksum beside it, the freshly mapped pages, or the link?"""
    def med(fn, n: int = 3) -> float:
        return statistics.median(_t(fn)[0] for _ in range(n))
    sync = torch.cuda.synchronize
    pspans, at = [], plain.data_ptr()
    for _, n in spans:
        pspans.append((at, n))
        at += n
    out: dict = {}
    out["plain_h2d_s"] = med(lambda: mover.to_device(pspans, pieces))
    out["plain_h2d_verify_overlapped_s"] = med(lambda: mover.to_device_checksum(pspans, pieces))
    out["plain_h2d_then_rows512_s"] = med(lambda: (mover.to_device(pspans, pieces), mover.clean_checksum(pspans)))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    flat = [(e, i) for ps in pieces for i, e in enumerate(ps)]

    def two():
        at = plain.data_ptr()
        for k, (e, _) in enumerate(flat):
            with torch.cuda.stream(streams[k % 2]):
                mover._dev(at, e.nbytes).copy_(mem.host_pool.view(e), non_blocking=True)
            at += e.nbytes
        sync()
    out["plain_h2d_two_streams_s"] = med(two)

    def cycle():
        tms.pause("weights")
        tms.resume("weights")
        sync()
    first, again, first_ck, slept = [], [], [], []
    for _ in range(3):
        cycle()
        first.append(_t(lambda: mover.to_device(spans, pieces))[0])
        again.append(_t(lambda: mover.to_device(spans, pieces))[0])
        cycle()
        first_ck.append(_t(lambda: mover.to_device_checksum(spans, pieces))[0])
        cycle()
        time.sleep(0.2)
        slept.append(_t(lambda: mover.to_device(spans, pieces))[0])
    gap = []                                    # 200 ms between the release and the map
    for _ in range(3):
        tms.pause("weights")
        sync()
        time.sleep(0.2)
        tms.resume("weights")
        sync()
        gap.append(_t(lambda: mover.to_device(spans, pieces))[0])
    out["tms_h2d_200ms_after_release_s"] = statistics.median(gap)
    out.update(tms_first_h2d_s=statistics.median(first), tms_again_h2d_s=statistics.median(again),
               tms_first_h2d_verify_overlapped_s=statistics.median(first_ck),
               tms_h2d_after_200ms_s=statistics.median(slept))
    return out


def child(gib: float, trips: int) -> dict:
    import torch

    from timeslice.torch_memory import TorchMemory
    size = int(gib * GIB) // CHUNK * CHUNK
    mem = TorchMemory({"weights": "offload"}, backup="pool", host_bytes={"weights": size})
    row: dict = {"gib": gib, "bytes": size}
    row["first_pin_s"], _ = _t(mem.prepin)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with mem.region("weights"):
        ws = [torch.randn(CHUNK // 4, device="cuda", generator=gen) for _ in range(size // CHUNK)]
    torch.cuda.synchronize()

    def wsum() -> int:
        return int(sum(int(w.view(torch.int32).sum(dtype=torch.int64).item()) for w in ws))
    want = wsum()
    book, mover, tms = mem.book, mem.book.mover, mem._tms
    mem.pause(["weights"])
    mem.resume(["weights"])
    mem.mark_clean("weights")
    mem.pause(["weights"])
    mem.resume(["weights"])
    r = book._regions["weights"]
    trips_out = []
    for _ in range(trips):
        torch.cuda.synchronize()
        p: dict = {}
        p["spans_s"], sp = _t(lambda: mover.spans("weights"))
        p["checksum_s"], ck = _t(lambda sp=sp: mover.checksum(sp))
        p["release_s"], _ = _t(lambda: (tms.pause("weights"), torch.cuda.synchronize()))
        p["map_s"], _ = _t(lambda: (tms.resume("weights"), torch.cuda.synchronize()))
        p["spans_again_s"], sp2 = _t(lambda: mover.spans("weights"))
        p["copy_in_verify_s"], got = _t(lambda sp2=sp2: mover.to_device_checksum(sp2, r.pieces))
        p["ok"] = ck == r.checksum and got == r.checksum and wsum() == want
        trips_out.append(p)
    row["clean_parts"] = trips_out
    spans = mover.spans("weights")
    pieces = r.pieces
    plain = torch.empty(size, dtype=torch.uint8, device="cuda")
    flat = [e for ps in pieces for e in ps]

    def copy_all(out: bool):
        at = 0
        for e in flat:
            d, h = plain[at:at + e.nbytes], mem.host_pool.view(e)
            (h.copy_(d, non_blocking=True) if out else d.copy_(h, non_blocking=True))
            at += e.nbytes
        torch.cuda.synchronize()
    copy_all(False)
    row["floor_h2d_s"] = statistics.median(_t(lambda: copy_all(False))[0] for _ in range(3))
    row["floor_d2h_s"] = statistics.median(_t(lambda: copy_all(True))[0] for _ in range(3))
    row["floor_h2d_gb_s"] = round(size / row["floor_h2d_s"] / 1e9, 1)
    row["pieces"] = len(flat)
    row["copies"] = _copies(torch, mem, tms, mover, spans, pieces, plain)
    row["checksums"] = _checksums(torch, mover, spans)
    plain = None
    torch.cuda.empty_cache()
    row["driver"] = _driver(size // CHUNK, CHUNK)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--trips", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a.gib, a.trips)), flush=True)
        os._exit(0)                              # tms 0.0.10 can fail a free at teardown; the result is out
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_swap_parts", "--child", "--gib", str(a.gib),
                        "--trips", str(a.trips)], capture_output=True, text=True)
    got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    row = json.loads(got[-1][7:]) if got else {"gib": a.gib, "error": (p.stdout + p.stderr)[-3000:]}
    row["child_exit_code"] = p.returncode
    if p.returncode != 0 and "error" not in row:
        row["error"] = f"the measuring process exited {p.returncode}: {(p.stderr or '')[-1000:]}"
    doc = {"command": "python -m benchmarks.gpu_swap_parts " + " ".join(argv if argv is not None else sys.argv[1:]),
           "row": row}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_swap_parts.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(row, indent=1))
    if "error" in row:
        print(f"FAILED (exit code {p.returncode})")
    return 0 if "error" not in row else 1


if __name__ == "__main__":
    sys.exit(main())
