"""Proof on a real GPU: two PyTorch RL-style jobs time-sliced through lockd and nodeagent.

Starts etcd, 3 lockd replicas and a node agent with the CUDA driver backend,
then runs two jobs (benchmarks/gpu_rl_job.py) standalone one after the other
and time-sliced, in three regimes:

  fit            both jobs fit side by side: swaps are elided (nothing moved)
  nofit          a ballast process leaves room for only one job: every handoff
                 snapshots the resident job and restores the incoming one
  nofit-nocache  as nofit, without releasing the allocator cache before yield
  nofit-coop     as nofit, with the cooperative backend: the jobs' weights live in a
                 torch-memory-saver region with a retained pinned backup, and the agent
                 asks each job to pause/resume itself (freeze on) instead of checkpointing it

Figures, headline first: the NVML duty cycle (share of time a kernel ran, sampled every
50 ms: what DCGM reports) and the end-to-end wall time of the pair against the same
two jobs one after the other (``wall_s``: from the first job process's start, torch
imported, to its last GPU phase's end, so start-up and pinning count; ``e2e_wall_s``:
from launching the first job to the last one's exit). Beside them the phase-based
duty (GPU phases over that wall; pinning inside a hold and waiting for a grant are
not GPU time), swaps, elided swaps, bytes moved, round trips; checks the weights'
checksum after every restore and the token history (no overlap, tokens increasing).
Writes JSON and a timeline PNG. Every job's exit code is recorded (standalone and time-sliced); a
run in which a job died is FAILED: its ratios are not printed, and the command exits 1.

    python -m benchmarks.gpu_timeslice --out benchmarks/results
    python -m benchmarks.gpu_timeslice --profile 40g_long --clean-weights --out $OUT

``--dry-run`` runs the same orchestration and analysis on the CPU: a SIMULATED GPU of
``--dry-run-capacity-gb`` (read as MiB, default 140: the H200 scaled GiB to MiB) that charges each
process an H200-like context and allocator slack, the node agent's simulated backend, a simulated
ballast, and ``benchmarks/sim_rl_job.py`` in place of ``gpu_rl_job.py`` (every size in MiB where it
says GiB). A dry run of the plumbing, not a measurement: its duty cycle is the phases', not NVML's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from timeslice.lockd.report.figures import union_length
from timeslice.testing.agent import AgentProcess
from timeslice.testing.etcd import EtcdCluster
from timeslice.testing.lockd import LockdCluster

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = "gpu-node-0"
GB = 1 << 30


class SimSampler(threading.Thread):
    """--dry-run: the SIMULATED device's free bytes; utilisation is not sampled (phases stand in)."""

    def __init__(self, sim_dir: str):
        super().__init__(daemon=True)
        from timeslice.common.sim.device import SimDevice
        self.dev = SimDevice(sim_dir)
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self):
        self.stop.wait()

    def mean_util(self, t0: float, t1: float) -> float:
        return 0.0

    def free_bytes(self) -> int:
        return self.dev.free_per_gpu()[0]


class NvmlSampler(threading.Thread):
    """GPU utilisation every 50 ms: util.gpu is the share of the last period a kernel ran."""

    def __init__(self):
        super().__init__(daemon=True)
        import pynvml
        pynvml.nvmlInit()
        self.nvml, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            u = self.nvml.nvmlDeviceGetUtilizationRates(self.h)
            m = self.nvml.nvmlDeviceGetMemoryInfo(self.h)
            self.samples.append((time.monotonic(), u.gpu, m.used))
            time.sleep(0.05)

    def mean_util(self, t0: float, t1: float) -> float:
        xs = [u for t, u, _ in self.samples if t0 <= t <= t1]
        return sum(xs) / len(xs) / 100 if xs else 0.0

    def free_bytes(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.h).free


# Named settings (explicit flags still win). 40g_long: the regime of gpu_timeslice_40g_long.json (two
# 40 GiB jobs, 6 s phases, 3 iterations) whose first pins made the pair slower than one after the other.
PROFILES = {
    "40g_long": {"iters": 3, "mem_gb": 40.0, "gen_s": 6.0, "reward_s": 8.0, "train_s": 6.0,
                 "regimes": "nofit-coop", "job_timeout": 280.0, "name": "gpu_timeslice_40g_long"},
    "4g_coop": {"iters": 3, "mem_gb": 4.0, "gen_s": 1.5, "reward_s": 3.0, "train_s": 1.5,
                "regimes": "nofit-coop", "job_timeout": 60.0, "name": "gpu_timeslice_4g_coop"},
}


def job_cmd(job, mode, out, a, target="", release_cache=1, hint=0, swap="checkpoint"):
    extra = ["--backup", a.backup] + (["--clean-weights"] if a.clean_weights and swap == "cooperative" else [])
    script = "gpu_rl_job.py"
    if a.dry_run:
        script = "sim_rl_job.py"
        extra += ["--sim-dir", a.sim_dir, "--residue-gb", str(a.dry_run_residue_gb)]
    return [sys.executable, os.path.join(HERE, script), "--job", job, "--mode", mode, "--out", out,
            "--swap", swap, *extra,
            "--target", target, "--iters", str(a.iters), "--gen-s", str(a.gen_s), "--reward-s", str(a.reward_s),
            "--train-s", str(a.train_s), "--mem-gb", str(a.mem_gb), "--scratch-gb", str(a.scratch_gb),
            "--release-cache", str(release_cache), "--hint-bytes", str(hint)]


def load(path):
    """The JSON lines of ``path``; [] if the jobs wrote nothing (a crash before their first phase)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_jobs(procs, timeout: float) -> list:
    """Each job's exit code, or "timeout" (then killed) for one that outlives ``timeout`` s of waiting."""
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append("timeout")
    return rcs


def analyse(events, sampler, label):
    phases = [e for e in events if e["ev"] == "phase"]
    if not phases:
        return {"label": label, "violations": ["no phase completed (job crashed?)"], "timeline": [],
                "wall_s": 0, "duty_cycle_phases": 0, "duty_cycle_nvml": 0, "swaps_restored": 0, "elided": 0,
                "bytes_moved": 0}
    gpu = [e for e in phases if e["gpu"]]
    starts = [e["t"] for e in events if e["ev"] == "start"]
    first_req = min(e.get("t_req", e["start"]) for e in phases)
    t0 = min(starts) if starts else first_req      # the job's start-up and pinning count
    t1 = max(e["end"] for e in phases)
    wall = t1 - t0

    def spans(e):                                   # GPU time of a phase: pinning inside it is not
        return [tuple(x) for x in e.get("gpu_spans") or [(e["start"], e["end"])]]
    busy = union_length([x for e in gpu for x in spans(e)])
    violations = []
    by_start = sorted(gpu, key=lambda e: e["start"])
    for x, y in zip(by_start, by_start[1:]):
        if y["start"] < x["end"] and x["job"] != y["job"]:
            violations.append(f"overlap: {x['job']} {x['phase']} and {y['job']} {y['phase']}")
    toks = [e["token"] for e in by_start if e.get("token")]
    if toks and any(b < a for a, b in zip(toks, toks[1:])):
        # the same job holding through consecutive phases may reuse a token; a *decrease* is the bug
        violations.append(f"tokens not increasing: {toks}")
    bad = [e for e in gpu if not e["checksum_ok"]]
    if bad:
        violations.append(f"{len(bad)} checksum failures")
    per_job = {}
    for e in events:
        if e["ev"] == "done":
            per_job[e["job"]] = {"wall_s": round(e["wall"], 2), "checksum_ok": e["checksum_ok"]}
    restored = [e for e in gpu if e.get("restored")]
    # Steady state: from the end of the last job's first GPU phase (which includes its one-time
    # allocation and, cooperative, the pinning of its host backup) to the end; what a long run of
    # many iterations approaches.
    firsts = [min(e["end"] for e in gpu if e["job"] == j) for j in {e["job"] for e in gpu}]
    s0 = max(firsts) if firsts else t1
    steady_busy = union_length([(max(a, s0), b) for e in gpu for a, b in spans(e) if b > s0])
    pinned = {e["job"]: round(e["end"] - e["start"], 3) for e in events if e["ev"] == "pinned"}
    inside = round(sum(e["end"] - e["start"] - sum(b - a for a, b in spans(e)) for e in gpu), 3)
    done = {e["job"]: e.get("backup_stats", {}) for e in events if e["ev"] == "done"}
    return {
        "pin_s": pinned, "pin_methods": {e["job"]: e.get("method") for e in events if e["ev"] == "pinned"},
        "pinning_inside_holds_s": inside, "backup_stats": {j: v for j, v in done.items() if v},
        "phases_wall_s": round(t1 - first_req, 2), "duty_cycle_nvml_phases_window":
            round(sampler.mean_util(first_req, t1), 3),
        "duty_cycle_steady": round(steady_busy / (t1 - s0), 3) if t1 > s0 else 0,
        "steady_window_s": round(t1 - s0, 2),
        "label": label, "wall_s": round(wall, 2), "gpu_busy_s": round(busy, 2),
        "duty_cycle_phases": round(busy / wall, 3) if wall else 0,
        "duty_cycle_nvml": round(sampler.mean_util(t0, t1), 3),
        "gpu_phases": len(gpu), "swaps_restored": len(restored),
        "elided": sum(1 for e in gpu if e.get("elided")),
        "bytes_moved": sum(e.get("bytes_moved", 0) for e in gpu),
        "wait_s": round(sum(e.get("waited_ms", 0) for e in gpu) / 1000, 2),
        "per_job": per_job, "violations": violations,
        "timeline": [{k: e[k] for k in ("job", "phase", "start", "end", "gpu", "token", "restored", "elided")
                      if k in e} for e in phases],
        "t0": t0,
    }


def run_standalone(a, sampler, workdir):
    out = os.path.join(workdir, "standalone.jsonl")
    t0 = time.monotonic()
    rcs = []
    for job in ("job-a", "job-b"):
        try:
            rcs.append(subprocess.run(job_cmd(job, "standalone", out, a), check=False,
                                      timeout=a.job_timeout).returncode)
        except subprocess.TimeoutExpired:
            rcs.append("timeout")
    res = analyse(load(out), sampler, "standalone (one after the other)")
    res["e2e_wall_s"] = round(time.monotonic() - t0, 2)
    res["job_exit_codes"] = rcs
    if any(rcs):
        res["violations"].append(f"job exit codes {rcs}")
    return res


def failed(r: dict) -> bool:
    """A run in which a job died, or that broke a rule: its figures are no result."""
    return bool(r.get("violations")) or any(r.get("job_exit_codes") or [])


def agent_ops(agent: AgentProcess):
    ops = [e for e in agent.events("op_done") if e.get("op") in ("snapshot", "restore") and e.get("outcome") == "ok"]
    out = {"ops": len(ops), "op_seconds": round(sum(e["elapsed_ms"] for e in ops) / 1000, 2),
           "op_bytes": sum(e.get("bytes", 0) for e in ops),
           "op_list": [(e["op"], e["job"], round(e["elapsed_ms"], 1), e.get("bytes", 0)) for e in ops]}
    # Strict groups: the driver's process lock (freeze) and unlock (thaw), as the agent timed them.
    locks = [e for e in agent.events("op_done") if e.get("op") in ("freeze", "thaw") and e.get("outcome") == "ok"]
    if locks:
        for op in ("freeze", "thaw"):
            ms = [e["elapsed_ms"] for e in locks if e["op"] == op]
            if ms:
                out[f"{op}s"] = len(ms)
                out[f"{op}_ms_median"] = round(statistics.median(ms), 2)
    # A swap's round trip for one job: its snapshot and its next restore. The first of each job
    # pays one-time costs (pinning); the steady state is the median of the others.
    trips = []
    for job in {e["job"] for e in ops}:
        mine = [e for e in ops if e["job"] == job]
        for s_, r_ in zip(mine, mine[1:]):
            if s_["op"] == "snapshot" and r_["op"] == "restore" and s_.get("bytes") and r_.get("bytes"):
                trips.append((s_["elapsed_ms"] + r_["elapsed_ms"]) / 1000)
    if trips:
        out.update(round_trips_s=[round(t, 3) for t in trips], round_trip_first_s=round(trips[0], 3),
                   round_trip_steady_median_s=round(statistics.median(trips[1:] or trips), 3))
    return out


def run_sliced(a, sampler, workdir, regime, release_cache, rep=0):
    tag = regime.replace(" ", "-") + (f"-{rep}" if rep else "")
    logdir = os.path.join(workdir, tag)
    os.makedirs(logdir, exist_ok=True)
    ballast = None
    # weights + activations (x, w, a@b, tanh: about twice --scratch-gb) + CUDA context
    gb = unit(a)
    peak = int((a.mem_gb + 2 * a.scratch_gb + 1.0) * gb)
    with EtcdCluster(1, workdir=logdir) as etcd:
        prefix = "/timeslice/"
        lockd = LockdCluster(etcd.endpoints_str, prefix, n=3, logdir=logdir,
                             extra=["--device-margin-bytes", str(gb // 4), "--swap-timeout", "60"]).start()
        if a.dry_run:
            agent = AgentProcess(etcd.endpoints_str, prefix, NODE, logdir, backend="sim", sim_dir=a.sim_dir,
                                 env={"TIMESLICE_SIM_HOST_DIR": a.sim_host_dir}).start()
        else:
            agent = AgentProcess(etcd.endpoints_str, prefix, NODE, logdir, backend="cuda-driver").start()
        try:
            from timeslice import OrchestratorClient
            admin = OrchestratorClient(target=",".join(lockd.targets), job_id="admin")
            # "-strict" regimes: the yielded job is frozen at the device on every elided handoff
            admin.create_group("gpu", nodes=[NODE], isolation="strict" if regime.endswith("-strict") else "")
            if regime.startswith("nofit"):
                # Room for one job at its peak plus 2 GB: not for the other's weights beside it.
                _settle(sampler)
                keep = peak + 2 * gb
                if "coop" in regime:
                    # A parked cooperative job keeps its CUDA context and allocator remnants on the
                    # device (measured 1.78 GiB with PyTorch on an H200); full isolation would move them.
                    keep += int(a.coop_residual_gb * gb)
                ballast_bytes = max(0, sampler.free_bytes() - keep)
                code = (("from timeslice.sim.runtime import SimDeviceClient; import time,sys;"
                         "d=SimDeviceClient.open(sys.argv[2]); d.alloc(max(1, int(sys.argv[1])));"
                         "print('ballast',flush=True); time.sleep(3600)") if a.dry_run else
                        ("import torch,time,sys; x=torch.empty(int(sys.argv[1]),dtype=torch.uint8,device='cuda');"
                         "torch.cuda.synchronize(); print('ballast',flush=True); time.sleep(3600)"))
                # A process outside timeslice: its memory is no job's (the simulated one's context counts too).
                if a.dry_run:
                    d = sampler.dev
                    ballast_bytes = max(1, int((ballast_bytes - d.context_bytes) / (1 + d.slack)))
                ballast = subprocess.Popen([sys.executable, "-c", code, str(ballast_bytes), a.sim_dir or ""],
                                           stdout=subprocess.PIPE)
                if not ballast.stdout.readline():
                    raise RuntimeError("the ballast process failed: the regime would not be a no-fit one")
            out = os.path.join(logdir, "jobs.jsonl")
            env = {**os.environ, "TIMESLICE_NODE_NAME": NODE, "TIMESLICE_AGENT_SOCKET": agent.socket}
            swap = "cooperative" if "coop" in regime else "checkpoint"
            procs = []
            t_launch = time.monotonic()
            for j in ("job-a", "job-b"):
                errf = open(os.path.join(logdir, f"{j}.stderr"), "wb")
                procs.append(subprocess.Popen(job_cmd(j, "sliced", out, a, ",".join(lockd.targets), release_cache,
                                                      peak, swap), env=env, stdout=errf, stderr=subprocess.STDOUT))
            rcs = wait_jobs(procs, a.job_timeout)
            e2e = round(time.monotonic() - t_launch, 2)
            events = load(out)
            res = analyse(events, sampler, f"time-sliced, {regime}")
            ready = [e for e in events if e["ev"] == "ready"]
            res.update(agent_ops(agent), job_exit_codes=rcs, release_cache=bool(release_cache), e2e_wall_s=e2e,
                       peak_bytes_hint=peak, swap=swap,
                       register_s={e["job"]: round(e.get("register_s", 0), 2) for e in ready},
                       memory=memory_figures(events, agent))
            if any(rcs):
                res["violations"].append(f"job exit codes {rcs}")
            return res
        finally:
            if ballast:
                ballast.kill()
                ballast.wait()      # its memory must be back before the next regime sizes its ballast
            agent.stop()
            lockd.stop()
            _keep_logs(logdir, tag)


def memory_figures(events, agent: AgentProcess) -> dict:
    """What the lock measured of each job's memory (README, "Memory a grant admits"): the peak and the
    context each job sent with its Acquires, the residue after each of its pauses, the room its
    allocations asked for, and the residue checkpoints the agent ran (the planner's and the room's)."""
    out: dict = {}
    for e in events:
        if e["ev"] == "done":
            out.setdefault(e["job"], {}).update(measured=e.get("measured", {}), residues=e.get("residues", []))
    for e in events:
        if e["ev"] == "phase" and e.get("gpu"):
            j = out.setdefault(e["job"], {})
            j["room_asks"] = max(j.get("room_asks", 0), int(e.get("room_asks", 0)))
    rooms = agent.events("room_residue_moved")
    full = [e for e in agent.events("cooperative_paused") if e.get("isolation") == "full"]
    out["agent"] = {"room_moves": len(rooms), "room_bytes": sum(int(e.get("bytes", 0)) for e in rooms),
                    "residue_checkpoints": len(full),
                    "residue_bytes": [e.get("residue_bytes") for e in agent.events("cooperative_paused")]}
    return out


def unit(a) -> int:
    """What --mem-gb and the other sizes count: GiB on a GPU, MiB on the simulated device (--dry-run)."""
    return (1 << 20) if a.dry_run else GB


def _settle(sampler, tries: int = 50) -> None:
    """Wait until the GPU's free memory stops rising (a previous regime's processes are gone)."""
    last = -1
    for _ in range(tries):
        free = sampler.free_bytes()
        if free <= last + (64 << 20):
            return
        last = free
        time.sleep(0.2)


def _keep_logs(logdir: str, tag: str) -> None:
    """Bundle a regime's logs (agent, lockd, jobs) into $OUT/<tag>-logs.tar.gz when $OUT is set."""
    out = os.environ.get("OUT")
    if not out:
        return
    import tarfile
    with tarfile.open(os.path.join(out, f"{tag}-logs.tar.gz"), "w:gz") as tar:
        for name in os.listdir(logdir):
            if name.endswith((".log", ".jsonl", ".stderr")):
                tar.add(os.path.join(logdir, name), arcname=name)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r for r in results if r.get("timeline")]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.6 * len(runs) + 0.6), squeeze=False)
    colours = {"generate": "tab:blue", "train": "tab:orange", "rewards": "lightgrey"}
    for ax, r in zip(axes[:, 0], runs):
        for e in r["timeline"]:
            y = 1 if e["job"] == "job-a" else 0
            ax.barh(y, e["end"] - e["start"], left=e["start"] - r["t0"], color=colours[e["phase"]], height=0.6)
            if e.get("restored"):
                ax.plot(e["start"] - r["t0"], y + 0.4, "v", color="red", markersize=6)
        ax.set_yticks([0, 1], ["job-b", "job-a"])
        ax.set_title(f"{r['label']}: NVML duty {r['duty_cycle_nvml']:.0%} (phases {r['duty_cycle_phases']:.0%}), "
                     f"wall {r['wall_s']:.0f} s", fontsize=9)
    axes[-1, 0].set_xlabel("seconds (blue: generate, orange: train, grey: rewards on CPU, red: restored)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(results) -> list[dict]:
    """Each time-sliced run against the one-after-the-other run: the pair's wall time as a fraction.
    A run in which a job died (or the baseline, if one of its jobs died) has no ratio: it is FAILED."""
    base = next((r for r in results if r["label"].startswith("standalone") and r.get("wall_s")), None)
    out = []
    for r in results:
        if base is None or r is base:
            continue
        if failed(r) or failed(base) or not r.get("wall_s"):
            out.append({"label": r["label"], "failed": True,
                        "why": (r.get("violations") or base.get("violations") or ["no wall time"])[:3]})
            continue
        row = {"label": r["label"], "wall_vs_one_after_the_other": round(r["wall_s"] / base["wall_s"], 3),
               "nvml_duty": r["duty_cycle_nvml"], "nvml_duty_one_after_the_other": base["duty_cycle_nvml"]}
        if r.get("e2e_wall_s") and base.get("e2e_wall_s"):
            row["e2e_wall_vs_one_after_the_other"] = round(r["e2e_wall_s"] / base["e2e_wall_s"], 3)
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="named settings (explicit flags override them)")
    p.add_argument("--backup", choices=["auto", "pool", "tms"], default="auto",
                   help="cooperative jobs' host backup (gpu_rl_job.py --backup)")
    p.add_argument("--clean-weights", action="store_true",
                   help="cooperative jobs mark their weights clean once loaded: only the first pause copies them")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--gen-s", type=float, default=1.5)
    p.add_argument("--reward-s", type=float, default=3.0)
    p.add_argument("--train-s", type=float, default=1.5)
    p.add_argument("--mem-gb", type=float, default=4.0)
    p.add_argument("--scratch-gb", type=float, default=2.0)
    p.add_argument("--job-timeout", type=float, default=150)
    p.add_argument("--regimes", default="fit,nofit,nofit-nocache")
    p.add_argument("--no-standalone", action="store_true", help="skip the one-after-the-other baseline")
    p.add_argument("--coop-residual-gb", type=float, default=1.5,
                   help="extra room left in the nofit-coop regime for the parked job's context")
    p.add_argument("--repeat", type=int, default=1, help="run the regimes this many times back to back")
    p.add_argument("--name", default="gpu_timeslice", help="file name stem of the results")
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: a SIMULATED GPU, sizes in MiB where they say GiB (not a measurement)")
    p.add_argument("--dry-run-capacity-gb", type=float, default=140.0,
                   help="--dry-run: the simulated GPU's capacity (MiB; the H200's 140 GiB scaled)")
    p.add_argument("--dry-run-residue-gb", type=float, default=1.2,
                   help="--dry-run: what a parked job keeps beside the device's context (MiB; the H200 job: "
                        "1.78 GiB in all, 0.6 of it its context)")
    a = p.parse_args()
    if a.profile:
        p.set_defaults(**PROFILES[a.profile])
        a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="gpu-ts-")
    a.sim_dir = a.sim_host_dir = ""
    if a.dry_run:
        from timeslice.common.sim.device import DEFAULT_SLACK, H200_CONTEXT_SHARE, SimDevice
        a.sim_dir, a.sim_host_dir = os.path.join(workdir, "sim"), os.path.join(workdir, "sim-host")
        cap = int(a.dry_run_capacity_gb * (1 << 20))
        # Set explicitly: the H200's context share and allocator slack, whatever the environment says.
        SimDevice(a.sim_dir, a.sim_host_dir, capacity_bytes=cap, context_bytes=int(cap * H200_CONTEXT_SHARE),
                  slack=DEFAULT_SLACK)
        os.environ["TIMESLICE_SIM_HOST_DIR"] = a.sim_host_dir
        sampler: NvmlSampler | SimSampler = SimSampler(a.sim_dir)
    else:
        sampler = NvmlSampler()
    sampler.start()
    results = [] if a.no_standalone else [run_standalone(a, sampler, workdir)]
    ideal = min(1.0, 2 * (a.gen_s + a.train_s) / (a.gen_s + a.reward_s + a.train_s))
    doc = {"command": "python -m benchmarks.gpu_timeslice " + " ".join(sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "params": vars(a), "ideal_duty_cycle": ideal,
           "results": results}

    def save():
        with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
            json.dump(doc, f, indent=1)

    save()
    for rep, regime in [(i, r) for i in range(a.repeat) for r in a.regimes.split(",")]:
        try:
            results.append(run_sliced(a, sampler, workdir, regime, 0 if "nocache" in regime else 1, rep))
        except Exception as e:   # keep the other regimes' figures; the failure is a result too
            results.append({"label": f"time-sliced, {regime}", "violations": [f"run failed: {e!r}"],
                            "timeline": [], "wall_s": 0, "duty_cycle_phases": 0, "duty_cycle_nvml": 0,
                            "swaps_restored": 0, "elided": 0, "bytes_moved": 0})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "timeline"}), flush=True)
        doc["comparison"] = compare(results)
        save()
    sampler.stop.set()
    png = os.path.join(a.out, f"{a.name}_timeline.png")
    plot(results, png)
    print(f"{'run':38} {'nvml':>6} {'wall s':>7} {'e2e s':>7} {'phases':>6} {'steady':>6} {'restores':>8} "
          f"{'elided':>6} {'GB moved':>8} {'op s':>6} {'trip s':>7} {'viol':>4}")
    for r in results:
        print(f"{r['label']:38} {r['duty_cycle_nvml']:6.0%} {r['wall_s']:7.1f} {r.get('e2e_wall_s', 0):7.1f} "
              f"{r['duty_cycle_phases']:6.0%} {r.get('duty_cycle_steady', 0):6.0%} "
              f"{r['swaps_restored']:8d} {r['elided']:6d} {r['bytes_moved'] / unit(a):8.1f} "
              f"{r.get('op_seconds', 0):6.1f} {r.get('round_trip_steady_median_s', 0):7.3f} "
              f"{len(r['violations']):4d}  exit codes {r.get('job_exit_codes', '?')}")
    for c in doc.get("comparison", []):
        if c.get("failed"):
            print(f"{c['label']}: FAILED ({'; '.join(c['why'])})")
            continue
        print(f"{c['label']}: wall x{c['wall_vs_one_after_the_other']} of one after the other"
              f" (end to end x{c.get('e2e_wall_vs_one_after_the_other', '?')}), NVML duty {c['nvml_duty']:.0%}"
              f" vs {c['nvml_duty_one_after_the_other']:.0%}")
    for r in results:
        for job, m in sorted((r.get("memory") or {}).items()):
            if job != "agent":
                print(f"{r['label']}: {job} measured {m.get('measured', {})}, residue after each pause "
                      f"{m.get('residues', [])}, room asked {m.get('room_asks', 0)}")
        if r.get("memory", {}).get("agent"):
            print(f"{r['label']}: agent {r['memory']['agent']}")
    print(f"ideal duty cycle {ideal:.0%}; timeline: {png}" + ("  (DRY RUN on the simulated device: not a "
                                                              "measurement)" if a.dry_run else ""))
    return 1 if any(failed(r) for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
