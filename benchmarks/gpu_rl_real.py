"""Proof on a real GPU with a real framework: two TRL GRPO jobs, standalone and time-sliced.

Runs examples/grpo/trl_job.py (TRL's GRPOTrainer through ``TimeslicedGRPOTrainer``;
a Qwen2-architecture model with random weights, generation with transformers, a CPU
reward of ``--reward-s`` seconds per batch) as two jobs with different seeds:

  standalone    one after the other, no lock (the baseline of the same run)
  cooperative   time-sliced; each job pauses its own torch-memory-saver regions
  strict        cooperative, in a strict group: the driver checkpoint takes the rest (full isolation)
  checkpoint    time-sliced; the agent checkpoints each parked process (CUDA driver API)

Each sliced regime gets a fresh etcd, lockd and node agent. The pair must not fit side by
side: where the jobs chosen would (one job's resident state plus the other's peak fits the
free memory), a ballast process holds the difference, and the JSON says how much. Figures
per regime (rl_real_figures.py): NVML duty cycle (the headline; sampled every 50 ms),
phase-based duty beside it, steps per job, each job's GPU-phase throughput against its
standalone run, swap round trip and bytes per swap (the agent's ops), residue after pause
(the job's own measure), first-pin time, and the degradation check: per-step losses and
final weight hashes identical, bit for bit, to the standalone runs. Deterministic kernels:
``torch.use_deterministic_algorithms(True, warn_only=True)`` (warnings are recorded),
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, cuDNN deterministic, eager attention, fixed seeds.

    python -m benchmarks.gpu_rl_real --out benchmarks/results            # the H200 run (~8 min)
    python -m benchmarks.gpu_rl_real --quick --out benchmarks/results    # a shorter one (~5 min)
    python -m benchmarks.gpu_rl_real --dry-run --out /tmp/x              # CPU, SIMULATED device (CI)
    python -m benchmarks.gpu_rl_real --kind plain --out benchmarks/results   # the 7B-class plain loop (~4 min)

``--kind plain`` runs examples/grpo/real_job.py instead: the plain transformers loop
(``@on_accelerators`` phases, ``ModelRegions``) at a Qwen2-7B-architecture config with bf16
weights and AdamW state, standalone and cooperative. Each job keeps ~46 GB resident and
peaks near 70 GB, so a parked job plus the other's peak fit the H200 only narrowly; the
ballast rule above decides. Its pinned backups take ~92 GB of host memory together; a
46 GB whole-process checkpoint would take most of a call's ten minutes, hence no
checkpoint regime by default.

``--dry-run`` runs the same orchestration and analysis on the CPU: a tiny model, the
SIMULATED device (``SimTorchMemory``: a pause overwrites the tensors with NaN, so a phase
run outside its hold shows in the degradation check), the sim agent; its checkpoint regime
gives each job a simulated arena the size of its state for the agent to move (the CPU
tensors themselves are not touched by it). No NVML there: phase duty only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import rl_real_figures as F
from benchmarks import rl_real_timeline as T
from benchmarks.common import machine_facts, table

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"trl": ROOT / "examples" / "grpo" / "trl_job.py", "plain": ROOT / "examples" / "grpo" / "real_job.py"}
NODE = "gpu-node-0"
GiB = 1 << 30
REGIMES = ("standalone", "cooperative", "strict", "checkpoint")   # the slowest last: a cut-short call keeps the rest
PROFILES = {   # name: job arguments
    # each step: ~6-7 s of generation and ~1 s of training on the H200 (estimated), 6 s of CPU reward
    "full": dict(size="1.5b", steps=3, batch=64, generations=8, prompt_len=64, completion_len=160, reward_s=6.0),
    "quick": dict(size="1.5b", steps=2, batch=64, generations=8, prompt_len=64, completion_len=128, reward_s=5.0),
    "dry-run": dict(size="tiny", steps=2, batch=8, generations=4, prompt_len=8, completion_len=8, reward_s=0.3),
    # --kind plain: the plain transformers loop at a 7B-class config, bf16 weights and AdamW state
    # (~46 GB resident per job: two never fit side by side); cooperative only by default.
    "plain-7b": dict(size="7b", steps=2, batch=16, generations=4, prompt_len=64, completion_len=128, reward_s=5.0,
                     dtype="bfloat16"),
}


def job_argv(a, seed: int, out: Path, swap: str, standalone: bool, hint: int = 0) -> list[str]:
    p = a.profile
    argv = [sys.executable, str(JOBS[a.kind]), "--out", str(out), "--seed", str(seed),
            "--device", "cpu" if a.dry_run else "cuda", "--dtype", p.get("dtype", a.dtype), "--lr", str(a.lr),
            "--size", p["size"], "--steps", str(p["steps"]),
            "--generations", str(p["generations"]), "--prompt-len", str(p["prompt_len"]),
            "--completion-len", str(p["completion_len"]), "--reward-s", str(p["reward_s"]), "--group", "gpu",
            "--hint-bytes", str(hint)]
    if a.kind == "trl":
        argv += ["--swap", swap, "--batch", str(p["batch"])]
    else:           # the plain loop cooperates (torch-memory-saver) on CUDA, SimTorchMemory without
        if swap != "cooperative":
            raise ValueError("the plain loop time-slices cooperatively only (regimes: cooperative, strict)")
        argv += ["--prompts", str(p["batch"] // p["generations"])]
    return argv + (["--standalone"] if standalone else [])


def core_halves(root: str = "/sys/devices/system/cpu") -> list[set[int]]:
    """This process's CPUs in two halves of whole physical cores (hyperthread siblings together).

    Why: time-sliced, one job's CPU phase (its reward) runs beside the other's GPU phase, and
    transformers' generate is launch-bound: sharing a physical core with a busy reward slowed
    it. A cluster gives each job its own cores (cpusets); the benchmark does the same, in the
    standalone runs too, so the baseline has the same CPUs."""
    mine = sorted(os.sched_getaffinity(0))
    cores: dict[str, set[int]] = {}
    for c in mine:
        try:
            key = Path(f"{root}/cpu{c}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(c)
        cores.setdefault(key, set()).add(c)
    groups = list(cores.values())
    if len(groups) < 2:
        return [set(mine), set(mine)]
    half = len(groups) // 2
    return [set().union(*groups[:half]), set().union(*groups[half:])]


def run_jobs(argvs: list[list[str]], env: dict, logdir: Path, timeout: float, together: bool,
             cpus: list[set[int]] | None = None) -> list[dict]:
    """Run the jobs (at once, or one after the other); their documents, in order."""
    procs, docs = [], []

    def start(i, argv):
        pin = cpus[i] if cpus else None
        with open(logdir / f"job-{i}.log", "wb") as log:    # the child keeps its own descriptor
            return subprocess.Popen(argv, env={**os.environ, **env, "TIMESLICE_JOB_ID": f"job-{'ab'[i]}"},
                                    stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None)

    if together:      # their loops start together, whatever their imports cost
        env = {**env, "TIMESLICE_EXAMPLE_BARRIER": f"{logdir / 'barrier'}:{len(argvs)}"}
    end = time.monotonic() + timeout
    for i, argv in enumerate(argvs):
        procs.append(start(i, argv))
        if not together:
            _wait(procs[-1], end)
    for p in procs:
        _wait(p, end)
    for i, argv in enumerate(argvs):
        out = Path(argv[argv.index("--out") + 1])
        if procs[i].returncode != 0 or not out.exists():
            tail = (logdir / f"job-{i}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"job {i} ended {procs[i].returncode}:\n{tail}")
        docs.append({**json.loads(out.read_text()), "exit_code": procs[i].returncode})
    return docs


def _wait(p: subprocess.Popen, end: float) -> None:
    try:
        p.wait(max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class Device:
    """The GPU (NVML sampler, ballast) or, dry run, the SIMULATED device of this benchmark."""

    def __init__(self, dry_run: bool, workdir: Path):
        self.dry_run, self.workdir = dry_run, workdir
        self.sampler = None
        self.ballast: subprocess.Popen | None = None
        if not dry_run:
            from benchmarks.gpu_timeslice import NvmlSampler
            self.sampler = NvmlSampler()
            self.sampler.start()

    def nvml(self, windows: list[tuple[float, float]]) -> float | None:
        if self.sampler is None:
            return None
        xs = [u for t, u, _ in self.sampler.samples if any(a <= t <= b for a, b in windows)]
        return round(sum(xs) / len(xs) / 100, 3) if xs else None

    def prepare(self, alone: list[dict], a) -> dict:
        """Make the pair not fit side by side; returns what was done."""
        if self.dry_run:
            from timeslice.common.sim.device import SimDevice
            from timeslice.sim.torch_memory import DEFAULT_CONTEXT_BYTES as ctx
            states = [d["state_bytes"] + ((d.get("dense") or {}).get("region_bytes") or 0) for d in alone]
            cap = 2 * ctx + max(states) + min(states) // 2    # both contexts and one job, never both jobs
            sim = self.workdir / "sim"
            SimDevice(sim, self.workdir / "host", capacity_bytes=cap)
            return {"simulated_capacity_bytes": cap, "fits_side_by_side": False}
        from benchmarks.gpu_timeslice import _settle
        _settle(self.sampler)
        free = self.sampler.free_bytes()
        peak = max(d.get("peak_bytes", 0) for d in alone) + int(a.context_gib * GiB)
        resident = min(sum(d["region_bytes"].values()) for d in alone)
        fits = resident + peak <= free
        keep = peak + int(a.coop_residue_gib * GiB) + GiB       # the incoming peak beside a parked job
        ballast = max(0, free - keep) if fits and a.ballast else 0
        if ballast:
            self.ballast = subprocess.Popen([sys.executable, "-c", (
                "import torch,time,sys; x=torch.empty(int(sys.argv[1]),dtype=torch.uint8,device='cuda');"
                "torch.cuda.synchronize(); print('ballast',flush=True); time.sleep(3600)"), str(ballast)],
                stdout=subprocess.PIPE)
            if not self.ballast.stdout or not self.ballast.stdout.readline():
                raise RuntimeError("the ballast process failed")
        return {"free_gib_before": round(free / GiB, 2), "job_peak_gib": round(peak / GiB, 2),
                "job_resident_gib": round(resident / GiB, 2), "fits_side_by_side": fits,
                "ballast_gib": round(ballast / GiB, 2)}

    def release(self) -> None:
        if self.ballast is not None:
            self.ballast.kill()
            self.ballast.wait()
            self.ballast = None


def sliced(a, dev: Device, regime: str, alone: list[dict], workdir: Path) -> dict:
    from timeslice import OrchestratorClient
    from timeslice.testing.agent import AgentProcess
    from timeslice.testing.etcd import EtcdCluster
    from timeslice.testing.lockd import LockdCluster
    logdir = workdir / regime
    logdir.mkdir()
    fit = dev.prepare(alone, a)
    env = {"TIMESLICE_NODE_NAME": NODE}
    agent_env: dict[str, str] = {}
    if a.dry_run:
        env.update(TIMESLICE_SIM_DIR=str(workdir / "sim"), TIMESLICE_SIM_HOST_DIR=str(workdir / "host"))
        agent_env = {"TIMESLICE_SIM_HOST_DIR": str(workdir / "host")}
    try:
        with EtcdCluster(1, workdir=str(logdir)) as etcd:
            lockd = LockdCluster(etcd.endpoints_str, "/timeslice/", n=1, logdir=str(logdir),
                                 extra=["--device-margin-bytes", str(0 if a.dry_run else 256 << 20),
                                        "--swap-timeout", "180"]).start()
            agent = AgentProcess(etcd.endpoints_str, "/timeslice/", NODE, str(logdir),
                                 backend="sim" if a.dry_run else "cuda-driver",
                                 sim_dir=workdir / "sim" if a.dry_run else None, env=agent_env,
                                 extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0"] if a.dry_run
                                 else []).start()
            try:
                env.update(TIMESLICE_TARGET=lockd.replicas[0].target, TIMESLICE_AGENT_SOCKET=agent.socket)
                with OrchestratorClient(target=lockd.replicas[0].target, job_id="admin") as admin:
                    admin.create_group("gpu", nodes=[NODE], isolation="strict" if regime == "strict" else "")
                swap = "checkpoint" if regime == "checkpoint" else "cooperative"
                # Each job tells lockd its peak (measured standalone, same run), as a user would:
                # its first step's optimizer state and activations are not on the device yet.
                # --hint-factor below 1 declares a peak that is too low (0.8: 20% short): the lock's own
                # measures (README, "Memory a grant admits") must keep every grant usable anyway.
                hints = [int((d.get("peak_bytes", 0) + (0 if a.dry_run else int(a.context_gib * GiB))) * a.hint_factor)
                         for d in alone]
                argvs = [job_argv(a, s, logdir / f"{j}.json", swap, False, h)
                         for (s, j), h in zip(((1, "a"), (2, "b")), hints)]
                docs = run_jobs(argvs, env, logdir, a.job_timeout, together=True, cpus=a.cpus)
                from benchmarks.gpu_timeslice import agent_ops
                ops = agent_ops(agent)
            finally:
                agent.stop()
                lockd.stop()
    finally:
        dev.release()
    res = F.regime_figures(docs)
    res.update(regime=regime, fit=fit, swap=F.swap_figures(ops, docs), degradation=F.degradation(docs, alone),
               agent_ops=ops)
    res["timeline"] = T.timeline(docs, alone)      # the order the jobs ran in, their waits, what ran beside
    res["pins"] = {d["job"]: d.get("pin") for d in docs}
    res["dense"] = {d["job"]: d.get("dense") for d in docs}
    return res


def keep_logs(logdir: Path, dest: Path) -> str:
    """A failed regime's logs (the jobs', the agent's, lockd's, etcd's), as one tarball beside the figures."""
    import tarfile
    with tarfile.open(dest, "w:gz") as tar:
        for f in sorted(logdir.rglob("*.log")):
            tar.add(f, arcname=str(f.relative_to(logdir)))
    return dest.name


def add_nvml(res: dict, dev: Device) -> None:
    """NVML duty over the regime's window (standalone: the two jobs' windows), and its steady part."""
    if res.get("sequential"):
        wins = [tuple(w) for w in res["windows"]]
        steady = [(max(w[0], f), w[1]) for w, f in zip(wins, res["steady_froms"])]
    else:
        wins, steady = [(res["t0"], res["t1"])], [(res["steady_from"], res["t1"])]
    res["duty_cycle_nvml"] = dev.nvml(wins)
    res["duty_cycle_nvml_steady"] = dev.nvml(steady)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, SIMULATED device (what CI runs)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter steps")
    p.add_argument("--kind", choices=sorted(JOBS), default="trl", help="trl (default) or plain (the 7B-class loop)")
    p.add_argument("--regimes", default="", help=f"default: {','.join(REGIMES)}; plain: standalone,cooperative")
    p.add_argument("--dtype", default="float32", help="weights (bf16 autocast in the steps); default %(default)s")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=0, help="override the profile's steps per job")
    p.add_argument("--reward-s", type=float, default=0.0, help="override the profile's reward seconds")
    p.add_argument("--job-timeout", type=float, default=300, help="per regime, s")
    p.add_argument("--ballast", type=int, default=1, help="1: hold the difference where the pair would fit")
    p.add_argument("--context-gib", type=float, default=0.75, help="CUDA context beside torch's peak (not counted)")
    p.add_argument("--hint-factor", type=float, default=1.0,
                   help="the jobs declare their measured peak times this (0.8: 20%% too low)")
    p.add_argument("--coop-residue-gib", type=float, default=1.5,
                   help="room left for a parked cooperative job's residue when sizing the ballast")
    p.add_argument("--name", default="", help="file name stem (default gpu_rl_real[_quick|_dryrun])")
    p.add_argument("--split-cores", action="store_true",
                   help="give each job half of the physical cores (its own cpuset), standalone runs too")
    a = p.parse_args(argv)
    a.cpus = core_halves() if a.split_cores else None
    a.profile = dict(PROFILES["dry-run" if a.dry_run else "plain-7b" if a.kind == "plain" else
                              "quick" if a.quick else "full"])
    if a.kind == "plain" and a.dry_run:
        a.profile["batch"] = 8
    a.regimes = a.regimes or (",".join(REGIMES) if a.kind == "trl" else "standalone,cooperative")
    if a.steps:
        a.profile["steps"] = a.steps
    if a.reward_s:
        a.profile["reward_s"] = a.reward_s
    name = a.name or "gpu_rl_real" + ("_plain" if a.kind == "plain" else "") + (
        "_dryrun" if a.dry_run else "_quick" if a.quick else "")
    regimes = [r for r in a.regimes.split(",") if r]
    if "standalone" not in regimes:
        regimes.insert(0, "standalone")       # the baseline and the degradation reference, same run
    os.makedirs(a.out, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-rl-real-"))
    dev = Device(a.dry_run, workdir)
    t_start = time.monotonic()
    doc: dict = {"benchmark": name, "command": "python -m benchmarks.gpu_rl_real " + " ".join(sys.argv[1:]),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine_facts(), "params": {k: v for k, v in vars(a).items() if k != "profile"},
                 "profile": a.profile, "simulated": a.dry_run, "regimes": {}}

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)

    (workdir / "standalone").mkdir()
    argvs = [job_argv(a, s, workdir / "standalone" / f"{j}.json", "cooperative", True) for s, j in ((1, "a"), (2, "b"))]
    alone = run_jobs(argvs, {}, workdir / "standalone", a.job_timeout * 2, together=False, cpus=a.cpus)
    base = F.regime_figures(alone, sequential=True)
    base.update(regime="standalone", sequential=True, dense={d["job"] + f"-{i}": d.get("dense") for i, d in enumerate(alone)})
    add_nvml(base, dev)
    doc["regimes"]["standalone"] = base
    save()
    failed = []
    for regime in regimes[1:]:
        try:
            res = sliced(a, dev, regime, alone, workdir)
            add_nvml(res, dev)
            res["vs_standalone"] = F.ratios(res, base)
        except Exception as e:   # keep the other regimes' figures: the failure is a result too
            res = {"regime": regime, "error": f"{type(e).__name__}: {str(e)[-2000:]}",
                   "logs": keep_logs(workdir / regime, Path(a.out) / f"{name}_{regime}_logs.tar.gz")}
            failed.append(regime)
        doc["regimes"][regime] = res
        save()
    if dev.sampler is not None:
        dev.sampler.stop.set()
    print(report(doc))
    with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
        f.write(report(doc) + "\n")
    ok = not failed and all(all(v["losses_identical"] and v["weights_identical"] for v in r["degradation"].values())
                            for k, r in doc["regimes"].items() if k != "standalone")
    doc["ok"] = ok
    save()
    return 0 if ok else 1


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def report(doc: dict) -> str:
    rows = []
    for name, r in doc["regimes"].items():
        if "error" in r:
            rows.append([name, "FAILED: " + r["error"].splitlines()[0][:80]] + [""] * 11)
            continue
        ratio = r.get("vs_standalone", {})
        jobs = r["jobs"]
        deg = r.get("degradation", {})
        sw = r.get("swap", {})
        rows.append([name, r["wall_s"], pct(r.get("duty_cycle_nvml")), pct(r["duty_cycle_phases"]),
                     pct(r["duty_cycle_phases_steady"]), "/".join(str(j["steps"]) for j in jobs),
                     "/".join(f"{ratio.get(j['job'], {}).get('tokens_per_s') or 1:.2f}" for j in jobs),
                     "/".join(f"{ratio.get(j['job'], {}).get('samples_per_s') or 1:.2f}" for j in jobs),
                     sw.get("round_trip_steady_median_s") or "-", sw.get("gib_per_swap", "-"),
                     f"{sw.get('residue_gib_max', 0):.2f}" if sw else "-",
                     "/".join(f"{j['first_pin_s']:.1f}" for j in jobs),
                     "yes" if deg and all(v["losses_identical"] and v["weights_identical"] for v in deg.values())
                     else ("-" if not deg else "NO")])
    head = ["regime", "wall s", "NVML", "phases", "steady", "steps", "tok/s x", "smp/s x", "trip s", "GiB/swap",
            "residue GiB", "pin s", "bit-equal"]
    note = ("SIMULATED device (CPU dry run): no NVML; swaps are the simulator's" if doc["simulated"]
            else "NVML duty: share of 50 ms samples a kernel ran, over each regime's window")
    lines = [f"{name}:\n{T.text(r['timeline'])}" for name, r in doc["regimes"].items() if "timeline" in r]
    return table(head, rows) + f"\n{note}; ratios (x) against standalone, same run" + "".join(
        "\n" + x for x in lines)


if __name__ == "__main__":
    raise SystemExit(main())
