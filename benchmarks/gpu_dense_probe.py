"""On a real GPU: dense generation (timeslice.integrations.dense) against transformers' generate, and
whether the captured graphs stay right across a swap of their region.

For each case (one child process each; the examples' shapes: TRL's 1.5B job, float32 weights under
bf16 autocast around each forward as accelerate does it, 64 rows; the plain 7B-class job, bf16, 16 rows):

* **eager**: ``model.generate`` (transformers, dynamic cache), sampling: tokens/s and NVML duty
  (the share of 50 ms samples a kernel ran) over the timed call (the second; the first warms up);
* **static**: the dense loop without graphs (``graphs=False``): the same kernels eagerly;
* **graphs**: the dense loop with the captured decode step: tokens/s, duty, capture time, the bytes
  of its region; its tokens must equal the static loop's for the same seed (the replay runs the
  captured kernels: bit-identical), greedy and sampled;
* **swap**: the graphs region paused (released, nothing copied) and resumed (new pages at the same
  addresses), the weights changed in place (as an optimizer step does), then both loops again: still
  equal (the graph reads the new weights through its baked pointers, the autocast casts included).

    python -m benchmarks.gpu_dense_probe --out $OUT                 # both cases (~2 min on the H200)
    python -m benchmarks.gpu_dense_probe --cases tiny --dry-run     # CPU: the same checks, no graphs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "trl-1.5b": dict(size="1.5b", dtype="float32", autocast=True, rows=64, prompt_len=64, new=160),
    "plain-7b": dict(size="7b", dtype="bfloat16", autocast=False, rows=16, prompt_len=64, new=128),
    "tiny": dict(size="tiny", dtype="float32", autocast=False, rows=8, prompt_len=8, new=12),
}


def child(name: str, device: str) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, str(ROOT / "examples" / "grpo"))
    import realmodel as R
    import torch

    from timeslice.integrations.dense import DenseGenerator
    c = CASES[name]
    R.deterministic()
    cuda = device == "cuda"
    sampler = None
    if cuda:
        from benchmarks.gpu_timeslice import NvmlSampler
        sampler = NvmlSampler()
        sampler.start()
        from timeslice.torch_memory import TorchMemory
        mem = TorchMemory({"weights": "offload", "graphs": "discard"}, backup="pool")
    else:
        torch.set_num_threads(2)
        from timeslice.common.sim.device import SimDevice
        from timeslice.sim.torch_memory import SimTorchMemory
        sim = Path(os.environ.get("TMPDIR", "/tmp")) / f"dense-probe-{os.getpid()}"
        SimDevice(sim / "sim", sim / "host", capacity_bytes=1 << 30)
        os.environ["TIMESLICE_SIM_HOST_DIR"] = str(sim / "host")
        mem = SimTorchMemory({"weights": "offload", "graphs": "discard"}, sim_dir=sim / "sim")
    with mem.region("weights"):
        model = R.build_model(c["size"], device, 1, c["dtype"])
    if hasattr(mem, "adopt"):
        mem.adopt("weights", list(model.parameters()))
    static = DenseGenerator(model, memory=mem, graphs=False)   # allocates first: see the module doc
    graphs = DenseGenerator(model, memory=mem, graphs=None if cuda else False)
    if c["autocast"] and cuda:                     # accelerate's mixed precision: autocast inside forward
        fwd = model.forward

        def forward(*args, **kwargs):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fwd(*args, **kwargs)
        model.forward = forward
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 90, (c["rows"], c["prompt_len"]), generator=g).to(device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=c["new"], eos_token_id=R.EOS, pad_token_id=R.PAD)

    def timed(fn, seed: int = 7, sample: bool = True):
        torch.manual_seed(seed)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.monotonic()
        out = fn(ids, attention_mask=mask, do_sample=sample, **kw)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.monotonic()
        tokens = int(out.shape[0] * (out.shape[1] - ids.shape[1]))
        print(f"[{name}] {getattr(fn, '__qualname__', fn)} seed {seed} sample {sample}: {t1 - t0:.2f} s",
              file=sys.stderr, flush=True)
        return out, {"s": round(t1 - t0, 4), "tokens_per_s": round(tokens / (t1 - t0), 1),
                     "nvml": round(sampler.mean_util(t0, t1), 3) if sampler else None}

    row: dict = {"case": name, **c, "device": device}
    timed(model.generate)
    _, row["eager"] = timed(model.generate)
    timed(static.generate)
    s_out, row["static"] = timed(static.generate)
    timed(graphs.generate)
    g_out, row["graphs"] = timed(graphs.generate)
    s_greedy, _ = timed(static.generate, sample=False)
    g_greedy, _ = timed(graphs.generate, sample=False)
    row["equal_sampled"] = bool(torch.equal(s_out, g_out))
    row["equal_greedy"] = bool(torch.equal(s_greedy, g_greedy))
    # A swap of the graphs' region, then new weights (an optimizer step writes them in place).
    mem.pause(["graphs"])
    mem.resume(["graphs"])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.001)
    s2, _ = timed(static.generate, seed=9)
    g2, row["graphs_after_swap"] = timed(graphs.generate, seed=9)
    row["equal_after_swap"] = bool(torch.equal(s2, g2))
    row["changed_by_new_weights"] = not torch.equal(s2, s_out)
    row["dense"] = graphs.stats.to_dict()
    row["speedup_x"] = round(row["graphs"]["tokens_per_s"] / row["eager"]["tokens_per_s"], 2)
    row["ok"] = row["equal_sampled"] and row["equal_greedy"] and row["equal_after_swap"] and (
        graphs.stats.graphs or not cuda)
    if sampler is not None:
        sampler.stop.set()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="trl-1.5b,plain-7b")
    ap.add_argument("--out", default=".")
    ap.add_argument("--dry-run", action="store_true", help="CPU, SIMULATED device: the checks without graphs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    device = "cpu" if a.dry_run else "cuda"
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.child, device)), flush=True)
        return 0
    rows = []
    for name in [x for x in a.cases.split(",") if x]:
        p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_dense_probe", "--child", name]
                           + (["--dry-run"] if a.dry_run else []), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        # stderr passes through: the child's progress and warnings (a failed capture says why) reach the
        # log as they come, also when a time limit ends the run
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(got[-1][7:]) if got else {"case": name, "ok": False, "rc": p.returncode,
                                                   "error": "the child printed no result (its stderr is in the log)"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"command": "python -m benchmarks.gpu_dense_probe " + " ".join(argv if argv is not None else sys.argv[1:]),
           "simulated": a.dry_run, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_dense_probe.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'case':>9} {'eager tok/s':>11} {'NVML':>5} {'graphs tok/s':>12} {'NVML':>5} {'x':>5} "
          f"{'capture s':>9} {'region MiB':>10} equal ok")
    for r in rows:
        if "graphs" not in r:
            print(f"{r['case']:>9} FAILED: {r.get('error', '')[-400:]}")
            continue
        pct = lambda x: "-" if x is None else f"{x:.0%}"          # noqa: E731
        print(f"{r['case']:>9} {r['eager']['tokens_per_s']:>11} {pct(r['eager']['nvml']):>5} "
              f"{r['graphs']['tokens_per_s']:>12} {pct(r['graphs']['nvml']):>5} {r['speedup_x']:>5} "
              f"{r['dense']['capture_s']:>9} {r['dense']['region_bytes'] / 2**20:>10.1f} "
              f"{r['equal_sampled'] and r['equal_greedy'] and r['equal_after_swap']} {r['ok']}")
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
