"""On a real GPU: the ways a JAX job's state can leave the device and come back, and what XLA keeps.

One JAX process (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``)
holds ``--gib`` of state as ``--leaves`` float32 arrays, and moves it out and back each way:

* ``memory``: the cooperative path itself, ``JaxMemory`` (``timeslice.integrations.jax``) with its
  chosen backup (``pool`` on a GPU with PyTorch: the project's pinned pool, copies by torch at the
  arrays' device addresses, checksums overlapped): the **first pin** (``declare`` + ``prepin``, before
  any array exists, as ``cooperate`` does it before the first hold), then dirty round trips (pause:
  copy out, delete; resume: new arrays, copy in, verify), then clean ones (the same arrays: no copy
  out, a checksum), the **residue** after a full pause (NVML for this process, and the live arrays
  left outside the regions), and device memory before and after;
* ``pool_copy``: the same pool, the copies alone (no checksum, no allocation);
* ``cupy``: the same pool, copies by CuPy (``memcpyAsync``), where CuPy is there;
* ``put_from_pool``: ``jax.device_put`` of NumPy views over the pool's (pinned) copy: XLA's own
  transfer from registered memory, the way in only;
* ``pinned_host``: ``jax.device_put`` to the ``pinned_host`` memory kind and back;
* ``device_get``: ``jax.device_get`` to NumPy and ``jax.device_put`` back.

Every way in is checked against the state's checksum. Then, one child process per allocator
(``bfc`` with preallocation off, ``platform``, ``cuda_async``): NVML's figure for the process
with 4 GiB allocated and after deleting it (does freed memory reach the driver?), and the
time of a small jitted step that allocates (what the allocator costs).

    python -m benchmarks.gpu_jax_probe --gib 16 --out $OUT       # the H200 (~2 min)
    python -m benchmarks.gpu_jax_probe --dry-run --out /tmp/x     # CPU: JAX's CPU backend, tiny
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # before JAX's backend starts
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

GIB = 1 << 30
ALLOCATORS = {"bfc": {"XLA_PYTHON_CLIENT_ALLOCATOR": "default"}, "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
              "cuda_async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}}

CHILD = r"""
import json, os, sys, time
import jax, jax.numpy as jnp
def used():
    try:
        import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return next((int(p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                     if p.pid == os.getpid()), None)
    except Exception:
        return None
d = jax.devices()[0]
out = {"platform": d.platform, "at_start": used()}
x = jnp.ones((4 << 28,), jnp.float32); x.block_until_ready()
out["with_4gib"] = used(); out["stats_keys"] = sorted((d.memory_stats() or {}).keys())[:12]
x.delete(); time.sleep(0.5); out["after_delete"] = used()
w = jax.random.normal(jax.random.key(0), (4096, 4096)); a = w
f = jax.jit(lambda a: jnp.tanh(a @ w) + 1.0)
for _ in range(5): a = f(a)
a.block_until_ready(); ts = []
for _ in range(60):
    t0 = time.perf_counter(); a = f(a); a.block_until_ready(); ts.append(time.perf_counter() - t0)
ts.sort(); out["step_ms_median"] = round(ts[len(ts) // 2] * 1000, 3)
print("RESULT " + json.dumps(out), flush=True)
"""


def _timed(fn):
    t0 = time.perf_counter()
    got = fn()
    return round(time.perf_counter() - t0, 4), got


def gbps(nbytes: int, s: float) -> float:
    return round(nbytes / s / 1e9, 2) if s > 0 else 0.0


def make_state(jax, gib: float, leaves: int) -> list:
    n = max(1, int(gib * GIB) // leaves // 4)
    keys = jax.random.split(jax.random.key(1), leaves)
    xs = [jax.random.normal(k, (n,), jax.numpy.float32) for k in keys]
    jax.block_until_ready(xs)
    return xs


def probe(a) -> dict:
    import jax

    from timeslice.integrations.jax import JaxMemory
    from timeslice.jax_regions import host_view, jax_checksum
    dev = jax.devices()[0]
    doc: dict = {"platform": dev.platform, "device": str(dev), "jax": jax.__version__,
                 "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")}}
    mem = JaxMemory({"state": "offload"})
    doc["backup"] = mem.backup
    n_leaf = max(1, int(a.gib * GIB) // a.leaves // 4)
    total = n_leaf * 4 * a.leaves
    doc["bytes"], doc["leaves"] = total, a.leaves
    mem.declare("state", total)
    before = mem.process_bytes()
    doc["first_pin_s"], _ = _timed(mem.prepin)            # no array exists yet: outside any hold
    doc["first_pin_gb_s"] = gbps(total, doc["first_pin_s"])
    doc["pin_method"] = getattr(mem.host_pool, "method", "heap")
    xs = make_state(jax, a.gib, a.leaves)
    sizes = [int(x.nbytes) for x in xs]
    ref = jax_checksum(jax, xs, sizes)
    mem["state"] = xs
    doc["device_bytes"] = {"before_state": before, "with_state": mem.process_bytes()}

    def trip(kind: str) -> dict:
        p, _ = _timed(lambda: mem.pause(["state"]))
        row = {"kind": kind, "pause_s": p, "residue_bytes": mem.residue_bytes(), "process_bytes": mem.process_bytes()}
        r, _ = _timed(lambda: mem.resume(["state"]))
        row.update(resume_s=r, round_trip_s=round(p + r, 4), intact=jax_checksum(jax, mem["state"], sizes) == ref)
        return row

    m = doc["memory"] = {"dirty": [], "clean": []}
    for n in range(a.trips):
        if n:
            mem["state"] = jax.block_until_ready([x + 0 for x in mem["state"]])   # new arrays: copied again
        m["dirty"].append(trip("dirty"))
    m["clean"] = [trip("clean") for _ in range(a.trips)]
    m["left_behind"], m["stats"] = mem.left_behind, mem.backup_stats()
    m["round_trip_dirty_median_s"] = statistics.median(t["round_trip_s"] for t in m["dirty"])
    m["round_trip_dirty_worst_s"] = max(t["round_trip_s"] for t in m["dirty"])
    m["round_trip_clean_median_s"] = statistics.median(t["round_trip_s"] for t in m["clean"])
    m["ok"] = all(t["intact"] for t in [*m["dirty"], *m["clean"]]) and m["stats"]["clean_skips"] == a.trips

    book = mem.book
    region = book._regions["state"]
    spans, pieces = list(region.layout or ()), region.pieces
    if mem.backup == "pool":
        mover = book.mover
        o, _ = _timed(lambda: mover.to_host(spans, pieces))
        for lf in mem._regions["state"].leaves:
            lf.array.delete()                            # to_device makes the arrays again, as a resume does
        i, _ = _timed(lambda: mover.to_device(spans, pieces))
        doc["pool_copy"] = {"out_s": o, "in_s": i, "out_gb_s": gbps(total, o), "in_gb_s": gbps(total, i),
                            "intact": jax_checksum(jax, [lf.array for lf in mem._regions["state"].leaves], sizes) == ref}
        mem._trees["state"] = [lf.array for lf in mem._regions["state"].leaves]
        try:
            doc["cupy"] = cupy_copies(jax, mem, spans, pieces, total, sizes, ref)
        except Exception as e:                           # a comparison only: the probe goes on
            doc["cupy"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            for lf in mem._regions["state"].leaves:      # the state as the memory last made it
                if lf.array is None or lf.array.is_deleted():
                    raise

    # XLA's own way in from the pool's copy (pinned on a GPU): NumPy views, jax.device_put.
    mem.pause(["state"])
    views = []
    for where in pieces:
        parts = [host_view(mem.host_pool, e) for e in where]
        views.append(parts[0].view("float32") if len(parts) == 1 else None)
    if all(v is not None for v in views):
        i, ys = _timed(lambda: jax.block_until_ready([jax.device_put(v, dev) for v in views]))
        doc["put_from_pool"] = {"in_s": i, "in_gb_s": gbps(total, i), "intact": jax_checksum(jax, ys, sizes) == ref}
        for y in ys:
            y.delete()
    mem.resume(["state"])
    xs = jax.block_until_ready([x + 0 for x in mem["state"]])   # the other ways work on plain arrays
    mem.close()
    doc["pinned_host"], xs = way(jax, xs, "pinned_host", a.trips, total, sizes, ref)
    doc["device_get"], xs = way(jax, xs, "device_get", 1, total, sizes, ref)
    for x in xs:
        x.delete()
    return doc


def way(jax, xs: list, kind: str, trips: int, total: int, sizes: list[int], ref: str) -> tuple[dict, list]:
    from timeslice.jax_regions import jax_checksum
    dev = jax.devices()[0]
    rows = []
    for _ in range(trips):
        t0 = time.perf_counter()
        if kind == "pinned_host":
            hs = jax.block_until_ready([jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in xs])
        else:
            hs = jax.device_get(xs)
        o = round(time.perf_counter() - t0, 4)
        for x in xs:
            x.delete()
        t0 = time.perf_counter()
        if kind == "pinned_host":
            xs = jax.block_until_ready([jax.device_put(h, h.sharding.with_memory_kind("device")) for h in hs])
            for h in hs:
                h.delete()
        else:
            xs = jax.block_until_ready([jax.device_put(h, dev) for h in hs])
        i = round(time.perf_counter() - t0, 4)
        del hs
        rows.append({"out_s": o, "in_s": i, "out_gb_s": gbps(total, o), "in_gb_s": gbps(total, i),
                     "intact": jax_checksum(jax, xs, sizes) == ref})
    return {"trips": rows, "ok": all(r["intact"] for r in rows)}, xs


def cupy_copies(jax, mem, spans, pieces, total: int, sizes: list[int], ref: str) -> dict:
    try:
        import cupy
    except Exception as e:                               # not installed: say so
        return {"skipped": f"{type(e).__name__}: {e}"[:200]}
    from timeslice.jax_regions import jax_checksum
    leaves = mem._regions["state"].leaves
    pool = mem.host_pool
    if not all(s.addr for s in pool.slabs):
        return {"skipped": "the pool's slabs are torch tensors (no address of our own)"}
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)

    def copy(out: bool) -> None:
        for leaf, where in zip(leaves, pieces):
            at = leaf.array.unsafe_buffer_pointer()
            for e in where:
                host = pool.slabs[e.slab].addr + e.offset
                if out:
                    rt.memcpyAsync(host, at, e.nbytes, rt.memcpyDeviceToHost, stream.ptr)
                else:
                    rt.memcpyAsync(at, host, e.nbytes, rt.memcpyHostToDevice, stream.ptr)
                at += e.nbytes
        stream.synchronize()
    o, _ = _timed(lambda: copy(True))
    for leaf in leaves:
        leaf.array.delete()
        leaf.array = jax.numpy.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)
    jax.block_until_ready([lf.array for lf in leaves])
    i, _ = _timed(lambda: copy(False))
    mem._trees["state"] = [lf.array for lf in leaves]
    return {"out_s": o, "in_s": i, "out_gb_s": gbps(total, o), "in_gb_s": gbps(total, i),
            "intact": jax_checksum(jax, [lf.array for lf in leaves], sizes) == ref}


def allocators() -> dict:
    out = {}
    for name, env in ALLOCATORS.items():
        e = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env}
        p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=e, timeout=120)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        out[name] = json.loads(got[-1][7:]) if got else {"error": (p.stderr or p.stdout)[-600:]}
    return out


def report(doc: dict) -> str:
    from benchmarks.common import table
    rows = []
    m = doc.get("memory", {})
    if m:
        d, c = m["dirty"], m["clean"]
        rows.append(["memory dirty (" + doc["backup"] + ")", statistics.median(t["pause_s"] for t in d),
                     statistics.median(t["resume_s"] for t in d), m["round_trip_dirty_median_s"], m["ok"]])
        rows.append(["memory clean", statistics.median(t["pause_s"] for t in c),
                     statistics.median(t["resume_s"] for t in c), m["round_trip_clean_median_s"], m["ok"]])
    for k in ("pool_copy", "cupy"):
        r = doc.get(k)
        if r and "out_s" in r:
            rows.append([k, r["out_s"], r["in_s"], round(r["out_s"] + r["in_s"], 4), r["intact"]])
    if doc.get("put_from_pool"):
        r = doc["put_from_pool"]
        rows.append(["put_from_pool (in only)", "-", r["in_s"], "-", r["intact"]])
    for k in ("pinned_host", "device_get"):
        for n, r in enumerate(doc.get(k, {}).get("trips", [])):
            rows.append([f"{k} #{n + 1}", r["out_s"], r["in_s"], round(r["out_s"] + r["in_s"], 4), r["intact"]])
    gb = doc["bytes"] / 1e9
    text = table(["way", "out s", "in s", "round trip s", "intact"], rows)
    text += (f"\n{gb:.1f} GB in {doc['leaves']} arrays on {doc['device']}; first pin {doc['first_pin_s']} s "
             f"({doc['first_pin_gb_s']} GB/s, {doc['pin_method']}, before any array existed)")
    if m:
        res = [t["residue_bytes"] for t in m["dirty"]]
        text += (f"\nresidue after a full pause: {max(res) / GIB:.3f} GiB (max of {len(res)}); arrays left outside "
                 f"the regions at the first pause: {m['left_behind']}")
        worst = m["round_trip_dirty_worst_s"]
        text += (f"\nround trip of {doc['bytes'] / GIB:.1f} GiB by JaxMemory: median {m['round_trip_dirty_median_s']} s, "
                 f"worst {worst} s ({'within' if worst <= 1.0 else 'OVER'} 1.0 s); the first pin came before any "
                 "array existed, as cooperate() makes it before the first hold")
    al = doc.get("allocators") or {}
    if al:
        arows = [[k, v.get("with_4gib"), v.get("after_delete"), v.get("step_ms_median"), v.get("error", "")[:60]]
                 for k, v in al.items()]
        text += "\n\n" + table(["allocator", "NVML with 4 GiB", "NVML after delete", "step ms", "error"], arows)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--leaves", type=int, default=64)
    ap.add_argument("--trips", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="JAX's CPU backend, a small state (CI)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        a.gib, a.leaves = min(a.gib, 1 / 64), min(a.leaves, 8)
    t0 = time.monotonic()
    doc = {"benchmark": "gpu_jax_probe", "simulated": False, "cpu_dry_run": a.dry_run,
           "command": "python -m benchmarks.gpu_jax_probe " + " ".join(argv if argv is not None else sys.argv[1:])}
    doc.update(probe(a))
    if not a.dry_run:
        doc["allocators"] = allocators()
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    ways = [doc["memory"]["ok"], doc["pinned_host"]["ok"], doc["device_get"]["ok"]]
    ways += [doc[k]["intact"] for k in ("pool_copy", "cupy", "put_from_pool") if k in doc and "intact" in doc[k]]
    doc["ok"] = all(ways)
    os.makedirs(a.out, exist_ok=True)
    name = "gpu_jax_probe_dryrun" if a.dry_run else "gpu_jax_probe"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    text = report(doc)
    with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
