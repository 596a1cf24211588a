"""On a real GPU: the cooperative swap's own pieces against the whole-process checkpoint, same worker.

A child process allocates ``--gib`` GiB of weights in a torch-memory-saver
region (``timeslice.torch_memory.TorchMemory``, retained pinned backup) and
opens the cooperative channel; this process runs the agent's side — the
channel server, ``CompositeBackend`` over the CUDA driver backend — and
measures, on the same 16 GiB worker:

* prepin (the one-time pinning, paid at registration), the first swap, and
  steady-state pause (+ freeze: the driver's lock) / unfreeze + resume;
* a stray device call while parked and frozen: it must block (not fault) and
  complete with the right checksum after the resume;
* the whole-process CUDA checkpoint (lock, checkpoint, restore, unlock) of the
  same process, for comparison;
* ``isolation=full``: pause, then checkpoint of what is left, and back.

    python -m benchmarks.gpu_swap_probe --gib 16 --rounds 5 --out $OUT
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

CHILD = r"""
import sys, time, json, threading, torch
from timeslice.torch_memory import TorchMemory
from timeslice.cooperative import CooperativeWorker
gib, sock = float(sys.argv[1]), sys.argv[2]
mem = TorchMemory({"weights": "offload", "kv_cache": "discard"})
chunk = 256 << 20
with mem.region("weights"):
    w = [torch.randn(chunk // 4, device="cuda") for _ in range(int(gib * 4))]
with mem.region("kv_cache"):
    kv = torch.zeros(1 << 28, dtype=torch.uint8, device="cuda")
def csum():
    return int(sum(int(t.view(torch.int32).sum(dtype=torch.int64).item()) for t in w))
expected = csum()
worker = CooperativeWorker("probe", "probe-secret", mem, "gpu-node-0", sock).start()
t0 = time.monotonic(); mem.prepin(); prepin = time.monotonic() - t0
print(json.dumps({"ready": worker.pid, "prepin_s": prepin, "region_bytes": mem.region_bytes()}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "check":
        print(json.dumps({"checksum_ok": csum() == expected}), flush=True)
    elif cmd == "stray":
        t0 = time.monotonic()
        ok = csum() == expected         # touches released pages: blocks while frozen
        print(json.dumps({"stray_ok": ok, "stray_blocked_s": time.monotonic() - t0}), flush=True)
    elif cmd == "quit":
        break
worker.close()
"""


def _wait(p, timeout=30):
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return "killed after timeout"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    from timeslice.nodeagent.backends.composite import CompositeBackend
    from timeslice.nodeagent.backends.cooperative import CooperativeSwapper
    from timeslice.nodeagent.backends.cuda_driver import CudaDriverBackend
    from timeslice.nodeagent.backends.records import SnapshotRecords
    from timeslice.nodeagent.channel import ChannelServer

    tmp = tempfile.mkdtemp(prefix="probe-")
    sock = os.path.join(tmp, "agent.sock")

    async def ok(job, secret):
        return None
    loop = asyncio.new_event_loop()
    server = ChannelServer(sock, "gpu-node-0", ok)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)

    child = subprocess.Popen([sys.executable, "-c", CHILD, str(a.gib), sock], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)

    def read():
        while True:
            line = child.stdout.readline()
            if not line:
                raise SystemExit("probe child died")
            if line.startswith("{"):
                return json.loads(line)

    def ask(cmd):
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return read()

    ready = read()
    pid = ready["ready"]
    base = CudaDriverBackend(records=SnapshotRecords(tmp))
    sw = CooperativeSwapper(server, pid, "probe")
    comp = CompositeBackend(base, lambda p: sw if p == pid else None)
    res = {"gib": a.gib, "prepin_s": ready["prepin_s"], "region_bytes": ready["region_bytes"], "rounds": []}
    for i in range(a.rounds):
        t0 = time.monotonic()
        comp.prepare("snapshot", [pid])
        n_out = comp.checkpoint(pid)
        t1 = time.monotonic()
        state_parked = f"{comp.get_state(pid)}/{base.get_state(pid)}"
        n_in = comp.restore(pid)
        t2 = time.monotonic()
        comp.finish([pid])
        res["rounds"].append({"out_s": t1 - t0, "in_s": t2 - t1, "bytes_out": n_out, "bytes_in": n_in,
                              "parked_state": state_parked})
        print(json.dumps(res["rounds"][-1]), flush=True)
    res["checksum_after_rounds"] = ask("check")["checksum_ok"]
    # Full isolation: pause, then the CUDA checkpoint takes the rest (context, kv scratch, cache).
    comp.prepare("snapshot", [pid], isolation="full")
    t0 = time.monotonic()
    comp.checkpoint(pid)
    t1 = time.monotonic()
    full_state = str(comp.get_state(pid))
    comp.restore(pid)
    t2 = time.monotonic()
    comp.finish([pid])
    res["full_isolation"] = {"out_s": t1 - t0, "in_s": t2 - t1, "parked_state": full_state,
                             "checksum_ok": ask("check")["checksum_ok"]}
    # The whole-process checkpoint of the same worker (today's backend), for comparison.
    t0 = time.monotonic()
    base.lock(pid, 10_000)
    moved = base.checkpoint(pid)
    t1 = time.monotonic()
    base.restore(pid)
    base.unlock(pid)
    t2 = time.monotonic()
    res["whole_process_checkpoint"] = {"out_s": t1 - t0, "in_s": t2 - t1, "bytes": moved,
                                       "checksum_ok": ask("check")["checksum_ok"]}
    res["child_died_before_stray"] = child.poll()     # the worker must have lived through every round
    # Last (it may cost the worker): a stray call while parked with the freeze on.
    frz = CompositeBackend(base, lambda p: sw if p == pid else None, freeze=True)
    frz.prepare("snapshot", [pid])
    frz.checkpoint(pid)
    frozen = str(base.get_state(pid))
    child.stdin.write("stray\n")
    child.stdin.flush()
    time.sleep(3.0)
    print(json.dumps({"stray_sent": True, "base_state": frozen, "child_alive": child.poll() is None}), flush=True)
    t0 = time.monotonic()
    try:
        frz.restore(pid)
    except Exception as e:
        print(json.dumps({"restore_error": str(e)[:200]}), flush=True)
    frz.finish([pid])
    try:
        stray = read()
    except SystemExit:
        stray = {"stray_ok": False, "stray_blocked_s": None, "child_died": True}
    res["stray"] = {**stray, "base_state_while_parked": frozen, "restore_s": time.monotonic() - t0, "child_exit": _wait(child),
                    "note": "freeze on: the stray call waits while parked; the unlock needed for the resume "
                            "releases it first and it faults on the not-yet-remapped pages"}
    if child.poll() is None:
        child.stdin.write("quit\n")
        child.stdin.flush()
        child.wait(60)
    steady = res["rounds"][1:] or res["rounds"]
    res["steady"] = {"out_s_median": statistics.median(r["out_s"] for r in steady),
                     "in_s_median": statistics.median(r["in_s"] for r in steady),
                     "round_trip_s_median": statistics.median(r["out_s"] + r["in_s"] for r in steady)}
    res["first_round_trip_s"] = res["rounds"][0]["out_s"] + res["rounds"][0]["in_s"]
    res["command"] = "python -m benchmarks.gpu_swap_probe " + " ".join(sys.argv[1:])
    with open(os.path.join(a.out, "gpu_swap_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    s, w = res["steady"], res["whole_process_checkpoint"]
    res["child_exit_code"] = child.returncode
    if res.get("child_died_before_stray") is not None:
        # The stray call may cost the worker (that is what it shows); dying before it, the worker leaves the
        # round trips unproven: no ratio.
        print(f"FAILED: the worker exited {res['child_died_before_stray']} before the stray call")
        return 1
    print(f"{'path':44} {'out s':>7} {'in s':>7} {'round trip':>10}")
    print(f"{'cooperative, steady state (median)':44} {s['out_s_median']:7.3f} {s['in_s_median']:7.3f} "
          f"{s['round_trip_s_median']:10.3f}")
    r0 = res["rounds"][0]
    print(f"{'cooperative, first swap':44} {r0['out_s']:7.3f} {r0['in_s']:7.3f} {res['first_round_trip_s']:10.3f}")
    fi = res["full_isolation"]
    print(f"{'cooperative + checkpoint of the rest (full)':44} {fi['out_s']:7.3f} {fi['in_s']:7.3f} "
          f"{fi['out_s'] + fi['in_s']:10.3f}")
    print(f"{'whole-process CUDA checkpoint':44} {w['out_s']:7.3f} {w['in_s']:7.3f} {w['out_s'] + w['in_s']:10.3f}")
    print(f"ratio whole-process / cooperative round trip: {(w['out_s'] + w['in_s']) / s['round_trip_s_median']:.1f}x;"
          f" prepin {res['prepin_s']:.2f} s; stray call with freeze: {res['stray']}; checksums {res['checksum_after_rounds']}, {fi['checksum_ok']}, "
          f"{w['checksum_ok']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
