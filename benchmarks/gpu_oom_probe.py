"""Probe on a GPU: can torch's own hooks make a failing allocation succeed once room is made? (no: retry at the site)

    python -m benchmarks.gpu_oom_probe --out "$OUT"      # one GPU, ~10 s

The make-room path (``timeslice.room``) needs a hook that runs when an allocation does not fit, lets
room be made (the node agent moves parked residue off the GPU), and has the allocation tried again.
Torch's caching allocator offers Python one hook at that moment: an out-of-memory observer
(``torch._C._cuda_attach_out_of_memory_observer``, called with the device, the size asked, the
device's total and free bytes). In one process on one GPU, this probe

1. fills the device until ``--free-gib`` is left, holding ``--room-gib`` of it in a tensor that stands
   for a parked job's residue (what the agent would move);
2. attaches an observer that, when called, drops that tensor (room made, as the agent would: the
   memory goes back to the device with ``cudaFree`` once nothing references it... here it goes back
   to the allocator's cache, which the very allocation could use);
3. asks for ``--room-gib`` more: records whether the observer ran, whether the allocation raised
   anyway (torch raises right after its observers: they cannot make it succeed), and then
4. retries the same allocation at the call site: records whether it succeeds now.

Expected (what ``timeslice.room`` is built on): observer called, the allocation raised anyway, the
retry at the site succeeded. Writes ``gpu_oom_probe.json`` under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

GiB = 1 << 30


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--free-gib", type=float, default=1.0, help="left free once the device is filled")
    p.add_argument("--room-gib", type=float, default=2.0, help="the 'residue' the observer drops, and the ask")
    a = p.parse_args()
    import torch
    dev = torch.device("cuda")
    torch.cuda.init()
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                 "observer_api": hasattr(torch._C, "_cuda_attach_out_of_memory_observer")}
    room = [torch.empty(int(a.room_gib * GiB), dtype=torch.uint8, device=dev)]
    free, total = torch.cuda.mem_get_info()
    fill = torch.empty(max(0, free - int(a.free_gib * GiB)), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    res["free_before_gib"] = round(torch.cuda.mem_get_info()[0] / GiB, 3)
    seen: list[dict] = []

    def observer(device, alloc, device_total, device_free):
        seen.append({"device": int(device), "alloc": int(alloc), "total": int(device_total),
                     "free": int(device_free), "t": time.monotonic()})
        room.clear()                      # room made while the allocation fails

    if res["observer_api"]:
        torch._C._cuda_attach_out_of_memory_observer(observer)
    ask = int(a.room_gib * GiB)
    t0 = time.monotonic()
    try:
        x = torch.empty(ask, dtype=torch.uint8, device=dev)
        res["first_attempt"] = "succeeded"
    except torch.OutOfMemoryError as e:
        res["first_attempt"] = "raised OutOfMemoryError"
        res["first_error"] = str(e).splitlines()[0][:300]
        x = None
    res["observer_called"] = len(seen)
    res["observer_calls"] = seen
    room.clear()
    try:
        if x is None:
            x = torch.empty(ask, dtype=torch.uint8, device=dev)
        res["retry_at_the_site"] = "succeeded"
    except torch.OutOfMemoryError as e:
        res["retry_at_the_site"] = f"raised: {str(e).splitlines()[0][:300]}"
    res["elapsed_s"] = round(time.monotonic() - t0, 3)
    res["verdict"] = ("the observer ran and the allocation raised anyway; the retry at the call site succeeded: "
                      "room must be made at the allocation's call site (timeslice.room.with_room)"
                      if res["observer_called"] and res["first_attempt"].startswith("raised")
                      and res["retry_at_the_site"] == "succeeded" else "see the figures")
    del x, fill
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_oom_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
