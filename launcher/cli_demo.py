"""``timeslice demo``: two synthetic RL jobs, first one after the other, then time-sliced.

    timeslice demo                    # uses the running local cluster, or starts one (and stops it after)
    timeslice demo --iterations 2     # shorter
    timeslice demo --out /tmp/demo    # where the timeline, events and summary go

Each job loops generate (GPU) -> rewards (CPU) -> train (GPU) with fixed,
complementary phase lengths. Without a GPU the "GPU" is the SIMULATED device
(real bytes that the node agent really snapshots and restores, checksummed);
with PyTorch and a CUDA GPU behind a CUDA-backed agent, real matmuls. The
demo prints each job's progress, the GPU duty cycle of every run, the swaps,
elided swaps and bytes moved (from the Acquire replies), and writes
timeline.png (its path is printed last).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from timeslice.auth import ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE
from timeslice.launcher import state as S
from timeslice.launcher.cli_up import add_cluster_flags, new_run_dir, server_extra_missing, settings_from_args
from timeslice.launcher.cluster import LaunchError, LocalCluster, Progress, _size
from timeslice.launcher.settings import SettingsError

GPU_JOB_BYTES = 1 << 30
MAX_SIM_JOB_BYTES = 1 << 30          # a running cluster with a bigger simulated device is not used


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="two RL jobs: one after the other, then time-sliced",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=3, help="iterations per job (default 3)")
    p.add_argument("--out", default=None, help="output folder (default <LOG_DIR>/<timestamp>-demo)")
    p.add_argument("--regimes", default="swap,coop,elide",
                   help="time-sliced runs: swap (the jobs do not fit side by side: real snapshots and restores), "
                        "elide (they do); comma-separated (default swap,elide)")
    # Complementary: the CPU phase is as long as the two GPU phases together.
    # On a real GPU they are twice as long: a swap there moves a CUDA context too.
    p.add_argument("--generate-s", type=float, default=None, help="generate phase, GPU, s (default 1.0; GPU 2.0)")
    p.add_argument("--rewards-s", type=float, default=None, help="rewards phase, CPU, s (default 1.5; GPU 3.0)")
    p.add_argument("--train-s", type=float, default=None, help="train phase, GPU, s (default 0.5; GPU 1.0)")
    p.add_argument("--gpu-job-bytes", type=int, default=GPU_JOB_BYTES,
                   help="device memory of each job's weights on a real GPU (default 1 GiB)")
    p.add_argument("--fresh-cluster", action="store_true",
                   help="start a cluster of the demo's own even if one is running")
    p.add_argument("--keep-cluster", action="store_true", help="leave the demo's own cluster running")
    add_cluster_flags(p)
    p.set_defaults(func=run)


def _pick_cluster(args, settings, out: Path, say) -> tuple[dict, LocalCluster | None]:
    """(cluster.json document, the cluster we started or None if we use a running one)."""
    if not args.fresh_cluster:
        found = S.find_running_anywhere(settings.log_dir)
        if found is not None:
            path, doc = found
            sim = doc.get("sim") or {}
            if doc.get("backend") == "sim" and int(sim.get("capacity_bytes") or 0) * 0.6 > MAX_SIM_JOB_BYTES:
                say(f"the running cluster ({path.parent}) has a {_size(int(sim['capacity_bytes']))} simulated "
                    "device, too big for a quick demo; starting one of the demo's own")
            elif doc.get("backend", "").startswith("cuda") and not _torch_cuda():
                say(f"the running cluster ({path.parent}) drives a real GPU but PyTorch with CUDA is not "
                    "importable here; starting one of the demo's own on the simulated device")
            else:
                say(f"using the running local cluster of {path.parent}/ (target {doc['target']})")
                if doc.get("admin_token_file") and not (os.environ.get(ENV_ADMIN_TOKEN)
                                                        or os.environ.get(ENV_ADMIN_TOKEN_FILE)):
                    os.environ[ENV_ADMIN_TOKEN_FILE] = doc["admin_token_file"]   # to create the demo's group
                return doc, None
    settings_overrides = {}
    if settings.backend == "auto" and not _torch_cuda():
        # Without PyTorch on CUDA the jobs can only compute on the simulator.
        say("no PyTorch with CUDA here: the jobs use the SIMULATED device (node agent backend sim)")
        settings_overrides["backend"] = "sim"
    if settings_overrides:
        from dataclasses import replace
        settings = replace(settings, **settings_overrides)
    run_dir = out / "cluster"
    say(f"starting a local cluster for the demo (logs in {run_dir}/)")
    cluster = LocalCluster(settings, run_dir, group=None, progress=Progress())
    cluster.start()
    return cluster.to_state(), cluster


def _gpu_name() -> str:
    """GPU 0's name from NVML (torch would create a CUDA context in this process)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # only a label
        return "(name unknown)"


def _torch_cuda() -> bool:
    from timeslice.launcher.demo.devices import torch_cuda_available
    return torch_cuda_available()


def run(args: argparse.Namespace) -> int:
    if (msg := server_extra_missing("demo")) is not None:
        print(msg, file=sys.stderr)
        return 1
    from timeslice.launcher.demo.runner import Demo, DemoError, DemoPlan, RunSpec, sim_runs

    def say(msg: str) -> None:          # with --json, stdout carries only the final JSON object
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        settings, _origin = settings_from_args(args)
    except SettingsError as e:
        print(f"timeslice demo: {e}", file=sys.stderr)
        return 2
    if args.iterations < 1:
        print("timeslice demo: --iterations must be >= 1", file=sys.stderr)
        return 2
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not regimes or set(regimes) - {"swap", "coop", "elide"}:
        print("timeslice demo: --regimes takes swap, coop and/or elide", file=sys.stderr)
        return 2
    out = (Path(args.out) if args.out else new_run_dir(settings.log_dir, "-demo")).absolute()
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()

    def on_term(_signum, _frame):
        raise KeyboardInterrupt
    old_term = signal.signal(signal.SIGTERM, on_term)
    cluster = None
    try:
        say(f"timeslice demo: output in {out}/")
        try:
            doc, cluster = _pick_cluster(args, settings, out, say)
        except LaunchError as e:
            print(f"timeslice demo: could not start the local cluster: {e}", file=sys.stderr)
            return 1
        gpu = doc.get("backend") != "sim"
        scale = 2.0 if gpu else 1.0

        def phase(given, default):
            return given if given is not None else default * scale
        plan = DemoPlan(iterations=args.iterations, generate_s=phase(args.generate_s, 1.0),
                    rewards_s=phase(args.rewards_s, 1.5), train_s=phase(args.train_s, 0.5))
        if not gpu:
            cap = int(doc["sim"]["capacity_bytes"])
            plan.device = "sim"
            plan.device_desc = f"SIMULATED device of {cap / 1e6:.0f} MB (node agent backend sim)"
            plan.runs = sim_runs(cap, regimes)
        else:
            plan.device = "cuda"
            plan.device_desc = f"CUDA GPU {_gpu_name()} (node agent backend {doc.get('backend')})"
            j = int(args.gpu_job_bytes)
            plan.runs = [RunSpec("baseline", "baseline: one job after the other, no sharing", "baseline", j)]
            if "swap" in regimes:
                plan.runs.append(RunSpec("sliced-swap", f"time-sliced, swapping (each job {j / 1e9:.1f} GB of "
                                         "weights; a ballast leaves room for one job)", "sliced", j, ballast=True))
            if "elide" in regimes:
                plan.runs.append(RunSpec("sliced-elide", f"time-sliced, elided (each job {j / 1e9:.1f} GB: "
                                         "both fit)", "sliced", j))
        say(f"\ntwo jobs, {plan.iterations_text()} each: {plan.phases_text()}")
        say(f"GPU: {plan.device_desc}")
        demo = Demo(plan, doc, out, say=say)
        try:
            results = demo.run_all()
        except DemoError as e:
            print(f"timeslice demo: {e}", file=sys.stderr)
            return 1
        table, png = demo.report(results)
        say("\nresults")
        say("\n".join("  " + line for line in table.splitlines()))
        say("\n  duty cycle = time some job computed on the GPU / wall time; swaps = grants that moved bytes;")
        say("  overlaps = GPU phases of different jobs that overlapped in time (must be 0)")
        say(f"\nsummary: {out / 'summary.json'}")
        say(f"demo took {time.monotonic() - t_all:.0f}s")
        say(f"timeline: {png}")
        bad = [fg.key for fg, _ in results if fg.overlaps or fg.bad_verifies or not fg.tokens_increasing]
        if args.json:
            summary_path = out / "summary.json"
            doc_out = {"out": str(out), "timeline": str(png), "ok": not bad, "failed_checks": bad,
                       "summary": json.loads(summary_path.read_text()) if summary_path.is_file() else None}
            print(json.dumps(doc_out, sort_keys=True), flush=True)
        if bad:
            print(f"timeslice demo: correctness check failed in {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if cluster is not None:
            if args.keep_cluster:
                say(f"the demo's cluster keeps running: timeslice up --stop --run-dir {cluster.run_dir}")
            else:
                say("stopping the demo's cluster")
                cluster.stop(quiet=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m timeslice.launcher.cli_demo ...`` (the same as ``timeslice demo ...``)."""
    from timeslice.cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
