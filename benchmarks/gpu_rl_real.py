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
    python -m benchmarks.gpu_rl_real --jobs 4 --mix fits,half,none --split-cores --out benchmarks/results
                                                                         # the fit policy's targets (~8 min)
    python -m benchmarks.gpu_rl_real --jobs 4 --mix half --dry-run --out /tmp/x   # two of four fit, CPU (CI)

``--kind plain`` runs examples/grpo/real_job.py instead: the plain transformers loop
(``@on_accelerators`` phases, ``ModelRegions``) at a Qwen2-7B-architecture config with bf16
weights and AdamW state, standalone and cooperative. Each job keeps ~46 GB resident and
peaks near 70 GB, so a parked job plus the other's peak fit the H200 only narrowly; the
ballast rule above decides. Its pinned backups take ~92 GB of host memory together; a
46 GB whole-process checkpoint would take most of a call's ten minutes, hence no
checkpoint regime by default.

``--jobs N --mix fits|half|none`` runs N TRL jobs (seeds 1..N) on a GPU sized so that all of
them, half of them, or one of them fit at a time (a ballast process holds the rest; the dry run
sizes the SIMULATED device so), in these regimes instead:

  standalone    one after the other, no lock (the baseline, and the degradation reference)
  nolock        the N jobs started together with no timeslice: only where they all fit (else
                skipped, and marked so), the ceiling a lock that shares can reach
  exclusive     time-sliced through an exclusive group (one holder at a time)
  fit           time-sliced through a group with sharing fit: side by side where the declared
                footprints (each job's standalone peak plus its context) fit, time-sliced elsewhere

Several mixes in one run (``--mix fits,half,none``) share one standalone baseline; each mix runs the
regimes its target needs (``MIX_DEFAULTS``; ``--regimes`` for all), keyed ``<mix>/<regime>``, and the
document's ``targets`` says whether each was met (``TARGETS``: fits, wall <= 1.1x and NVML >= 0.9x
nolock's; half, wall <= 0.5x one after the other; none, wall within 5% of the exclusive group's).
Per regime: wall against one after the other and against nolock (``wall_vs_no_lock``), NVML duty
(and against nolock), each job's GPU-phase throughput, every job's exit code, bit-identity with
the standalone runs, and how the holds overlapped (the most jobs holding at once, holds beside
another, backfills, any beside a hold that weighed the whole device).

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

from benchmarks import rl_real_density as D
from benchmarks import rl_real_figures as F
from benchmarks import rl_real_timeline as T
from benchmarks.common import machine_facts, table

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"trl": ROOT / "examples" / "grpo" / "trl_job.py", "plain": ROOT / "examples" / "grpo" / "real_job.py"}
NODE = "gpu-node-0"
GiB = 1 << 30
MARGIN_BYTES = 256 << 20          # lockd's --device-margin-bytes on the GPU
REGIMES = ("standalone", "cooperative", "strict", "checkpoint")   # the slowest last: a cut-short call keeps the rest
MIXES = ("fits", "half", "none")                                  # --mix: all, half, or one of the N jobs fit at once
MIX_REGIMES = ("nolock", "exclusive", "fit")
# What each mix is compared with unless --regimes says otherwise: the jobs together with no lock where
# they all fit, one after the other (the standalone baseline, always run) where half fit, an
# exclusive group where one fits at a time.
MIX_DEFAULTS = {"fits": ("nolock", "fit"), "half": ("fit",), "none": ("exclusive", "fit")}
#: The figures a --mix run must show (the targets of the fit policy), checked into the document.
TARGETS = {"fits": [("fit", "wall_vs_no_lock", "<=", 1.1), ("fit", "nvml_vs_no_lock", ">=", 0.9)],
           "half": [("fit", "wall_vs_standalone", "<=", 0.5)],
           "none": [("fit", "wall_vs_exclusive", "<=", 1.05)]}


def job_id(i: int) -> str:
    """The i-th job's id: job-a, job-b, ... (seed i + 1)."""
    return f"job-{chr(ord('a') + i)}" if i < 26 else f"job-{i}"


def fitting(a) -> int:
    """How many of the jobs fit the device at once: --mix's (the pair mode: one)."""
    return {"fits": a.jobs, "half": max(1, a.jobs // 2), "none": 1}.get(a.mix or "none", 1)


class JobsFailed(RuntimeError):
    """A regime in which a job did not end with exit code 0 (its figures would mean nothing)."""

    def __init__(self, exit_codes: list, message: str):
        super().__init__(message)
        self.exit_codes = exit_codes
PROFILES = {   # name: job arguments
    # each step: ~6-7 s of generation and ~1 s of training on the H200 (estimated), 6 s of CPU reward
    "full": dict(size="1.5b", steps=3, batch=64, generations=8, prompt_len=64, completion_len=160, reward_s=6.0),
    "quick": dict(size="1.5b", steps=2, batch=64, generations=8, prompt_len=64, completion_len=128, reward_s=5.0),
    "dry-run": dict(size="tiny", steps=2, batch=8, generations=4, prompt_len=8, completion_len=8, reward_s=0.3),
    # --kind plain: the plain transformers loop at a 7B-class config, bf16 weights and AdamW state
    # (~46 GB resident per job: two never fit side by side); cooperative only by default.
    "plain-7b": dict(size="7b", steps=2, batch=16, generations=4, prompt_len=64, completion_len=128, reward_s=5.0,
                     dtype="bfloat16"),
    # --mix on the GPU: Qwen2-0.5B-architecture jobs (~10 GiB each alone), short steps, a 0.5 s CPU reward
    "mix": dict(size="0.5b", steps=8, batch=16, generations=4, prompt_len=32, completion_len=64, reward_s=0.5),
    # --jobs 4 --mix none, dense generation: Qwen2-0.5B-architecture jobs in bf16 (~3 GiB of state each:
    # a handoff moves little), long completions so that a GPU phase is seconds of dense decode, and a
    # CPU reward about three GPU phases long, so that four jobs can keep the GPU busy (N x d near 1)
    "dense4": dict(size="0.5b", steps=4, batch=64, generations=8, prompt_len=64, completion_len=768, reward_s=5.0,
                   dtype="bfloat16"),
}


def job_argv(a, seed: int, out: Path, swap: str, standalone: bool, hint: int = 0) -> list[str]:
    p = a.profile
    argv = [sys.executable, str(JOBS[a.kind]), "--out", str(out), "--seed", str(seed),
            "--device", "cpu" if a.dry_run else "cuda", "--dtype", p.get("dtype", a.dtype), "--lr", str(a.lr),
            "--size", p["size"], "--steps", str(p["steps"]),
            "--generations", str(p["generations"]), "--prompt-len", str(p["prompt_len"]),
            "--completion-len", str(p["completion_len"]), "--reward-s", str(p["reward_s"]), "--group", "gpu",
            "--hint-bytes", str(hint), "--generation", a.generation]
    if a.kind == "trl":
        argv += ["--swap", swap, "--batch", str(p["batch"])]
    else:           # the plain loop cooperates (torch-memory-saver) on CUDA, SimTorchMemory without
        if swap != "cooperative":
            raise ValueError("the plain loop time-slices cooperatively only (regimes: cooperative, strict)")
        argv += ["--prompts", str(p["batch"] // p["generations"])]
    return argv + (["--standalone"] if standalone else [])


def core_halves(root: str = "/sys/devices/system/cpu") -> list[set[int]]:
    return core_parts(2, root)


def core_parts(n: int, root: str = "/sys/devices/system/cpu") -> list[set[int]]:
    """This process's CPUs in ``n`` parts of whole physical cores (hyperthread siblings together).

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
    if len(groups) < n:
        return [set(mine) for _ in range(n)]
    per = len(groups) // n
    return [set().union(*groups[i * per:(i + 1) * per if i < n - 1 else len(groups)]) for i in range(n)]


def run_jobs(argvs: list[list[str]], env: dict, logdir: Path, timeout: float, together: bool,
             cpus: list[set[int]] | None = None) -> list[dict]:
    """Run the jobs (at once, or one after the other); their documents, in order. JobsFailed, with
    every job's exit code, when one did not end 0 or wrote nothing."""
    procs, docs = [], []

    def start(i, argv):
        pin = cpus[i % len(cpus)] if cpus else None
        with open(logdir / f"job-{i}.log", "wb") as log:    # the child keeps its own descriptor
            return subprocess.Popen(argv, env={**os.environ, **env, "TIMESLICE_JOB_ID": job_id(i)},
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
    rcs = [p.returncode for p in procs]
    for i, argv in enumerate(argvs):
        out = Path(argv[argv.index("--out") + 1])
        if procs[i].returncode != 0 or not out.exists():
            tail = (logdir / f"job-{i}.log").read_text(errors="replace")[-3000:]
            raise JobsFailed(rcs, f"job {i} ended {procs[i].returncode} (exit codes {rcs}):\n{tail}")
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
        """Size the device: the pair must not fit side by side; with --mix, k = fitting(a) of the N
        jobs fit at once (the rest parked beside them). Returns what was done."""
        k, n = fitting(a), len(alone)
        if self.dry_run:
            from timeslice.common.sim.device import SimDevice
            from timeslice.sim.torch_memory import DEFAULT_CONTEXT_BYTES as ctx
            # the regions a job keeps: its state and its dense generator's cache and graph buffers
            states = sorted(d["state_bytes"] + ((d.get("dense") or {}).get("region_bytes") or 0) for d in alone)
            if a.mix:
                # By what lockd admits for the footprints the jobs declare (hint_of; lockd/footprints.py:
                # the declaration, the measured context, the margin, a first hold's spare): k of them fit
                # (beside the parked jobs' residue where it can, else lockd moves a residue out first);
                # never k + 1, first holds or later.
                from timeslice.lockd import footprints as FP

                def admitted(d: dict, cap: int, steady: bool) -> int:
                    # a first hold: the declaration, no context measured yet (a share of the GPU), the
                    # first-hold spare; later: the peak reported and the context measured
                    return FP.admitted(FP.footprint({0}, hint=hint_of(a, d), peak=hint_of(a, d) if steady else 0,
                                                    context=ctx if steady else 0, capacity={0: cap}), 0)
                cap = sum(states) + n * ctx
                for _ in range(4):                 # the unmeasured context is a share of the capacity itself
                    first = [admitted(d, cap, False) for d in alone]
                    steady = [admitted(d, cap, True) for d in alone]
                    fp = max(steady)
                    want = max(k * fp + (n - k) * ctx + fp // 2, max(first) + (n - 1) * ctx + ctx // 2)
                    # no k + 1 of them, first holds or later, not even the smallest, also with every parked
                    # job's residue moved off the device (lockd moves it to make room for a grant)
                    cap = want if k >= n else min(want, (k + 1) * min(first + steady) - 1)
                if cap < k * fp:
                    raise RuntimeError(f"cannot size the simulated device: {k} jobs need {k * fp} bytes, "
                                       f"{k + 1} first holds fit in {cap}")
            else:
                # both contexts and one job, never both jobs
                cap = n * ctx + states[-1] + states[0] // 2
            sim = self.workdir / "sim"
            SimDevice(sim, self.workdir / "host", capacity_bytes=cap)
            return {"simulated_capacity_bytes": cap, "fits_side_by_side": k > 1, "fit_at_once": k}
        from benchmarks.gpu_timeslice import _settle
        _settle(self.sampler)
        free = self.sampler.free_bytes()
        peak = max(d.get("peak_bytes", 0) for d in alone) + int(a.context_gib * GiB)
        resident = min(sum(d["region_bytes"].values()) for d in alone)
        if a.mix:
            # k footprints side by side (what lockd admits each on a first hold: the footprint rule of
            # lockd/footprints.py over what the job declares), the others parked (their residue), lockd's
            # margin beside each, a GiB of slack; in steady state (a smaller footprint: peaks reported)
            # still never k + 1 (a sized run says so: fit_at_once_steady).
            from timeslice.lockd import footprints as FP
            total = self.sampler.nvml.nvmlDeviceGetMemoryInfo(self.sampler.h).total
            first = max(FP.admitted(FP.footprint({0}, hint=hint_of(a, d), capacity={0: total}), 0) for d in alone)
            steady = max(FP.admitted(FP.footprint({0}, hint=hint_of(a, d), peak=d.get("peak_bytes", 0),
                                                  capacity={0: total}), 0) for d in alone)
            residue, margin = int(a.coop_residue_gib * GiB), MARGIN_BYTES
            keep = k * (first + margin) + (n - k) * residue + GiB
            fits = keep <= free
            ballast = max(0, free - keep) if a.ballast and k < n else 0
            room = free - ballast
            fit = {"free_gib_before": round(free / GiB, 2), "job_peak_gib": round(peak / GiB, 2),
                   "admitted_first_gib": round(first / GiB, 2), "admitted_steady_gib": round(steady / GiB, 2),
                   "fit_at_once": k, "fit_at_once_steady": min(n, int((room - GiB) // (steady + margin + residue))),
                   "fits_side_by_side": k > 1 and fits, "ballast_gib": round(ballast / GiB, 2)}
            self._ballast(ballast)
            return fit
        fits = resident + peak <= free
        keep = peak + int(a.coop_residue_gib * GiB) + GiB       # the incoming peak beside a parked job
        ballast = max(0, free - keep) if fits and a.ballast else 0
        self._ballast(ballast)
        return {"free_gib_before": round(free / GiB, 2), "job_peak_gib": round(peak / GiB, 2),
                "job_resident_gib": round(resident / GiB, 2), "fits_side_by_side": fits,
                "ballast_gib": round(ballast / GiB, 2)}

    def _ballast(self, ballast: int) -> None:
        """A process outside timeslice holding ``ballast`` bytes of the GPU (0: none)."""
        if ballast:
            self.ballast = subprocess.Popen([sys.executable, "-c", (
                "import torch,time,sys; x=torch.empty(int(sys.argv[1]),dtype=torch.uint8,device='cuda');"
                "torch.cuda.synchronize(); print('ballast',flush=True); time.sleep(3600)"), str(ballast)],
                stdout=subprocess.PIPE)
            if not self.ballast.stdout or not self.ballast.stdout.readline():
                raise RuntimeError("the ballast process failed")

    def release(self) -> None:
        if self.ballast is not None:
            self.ballast.kill()
            self.ballast.wait()
            self.ballast = None


def hint_of(a, doc: dict) -> int:
    """What a job declares (its Acquire's device_bytes_hint): its standalone peak, same run, plus its
    CUDA context, as a user would; the dry run's jobs measure no peak alone (no device), so there it is
    their state plus the simulated context (the pair mode keeps its old figure, the peak: 0 there)."""
    if a.dry_run:
        if not a.mix:
            return doc.get("peak_bytes", 0)
        from timeslice.sim.torch_memory import DEFAULT_CONTEXT_BYTES
        dense = (doc.get("dense") or {}).get("region_bytes") or 0       # the dense generator's buffers
        return doc["state_bytes"] + dense + DEFAULT_CONTEXT_BYTES
    return doc.get("peak_bytes", 0) + int(a.context_gib * GiB)


def sliced(a, dev: Device, regime: str, alone: list[dict], workdir: Path, where: str = "") -> dict:
    """One time-sliced regime, on a fresh etcd, lockd and agent; ``where``: its folder (default: its name)."""
    from timeslice import OrchestratorClient
    from timeslice.testing.agent import AgentProcess
    from timeslice.testing.etcd import EtcdCluster
    from timeslice.testing.lockd import LockdCluster
    logdir = workdir / (where or regime)
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
                                 extra=["--device-margin-bytes", str(0 if a.dry_run else MARGIN_BYTES),
                                        "--swap-timeout", "180"]).start()
            agent = AgentProcess(etcd.endpoints_str, "/timeslice/", NODE, str(logdir),
                                 backend="sim" if a.dry_run else "cuda-driver",
                                 sim_dir=workdir / "sim" if a.dry_run else None, env=agent_env,
                                 extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0"] if a.dry_run
                                 else []).start()
            try:
                env.update(TIMESLICE_TARGET=lockd.replicas[0].target, TIMESLICE_AGENT_SOCKET=agent.socket)
                with OrchestratorClient(target=lockd.replicas[0].target, job_id="admin") as admin:
                    # GPU 0 alone (the one the jobs, the ballast and the NVML sampler use): on a host of
                    # several GPUs run with CUDA_VISIBLE_DEVICES=0, e.g. for the host memory of three 7B jobs.
                    admin.create_group("gpu", nodes=[(NODE, [0])], isolation="strict" if regime == "strict" else "",
                                       sharing="fit" if regime == "fit" else "exclusive")
                swap = "checkpoint" if regime == "checkpoint" else "cooperative"
                # Each job tells lockd its peak (measured standalone, same run), as a user would:
                # its first step's optimizer state and activations are not on the device yet.
                # --hint-factor below 1 declares a peak that is too low (0.8: 20% short): the lock's own
                # measures (README, "Memory a grant admits") must keep every grant usable anyway.
                hints = [int(hint_of(a, d) * a.hint_factor) for d in alone]
                argvs = [job_argv(a, i + 1, logdir / f"{job_id(i)}.json", swap, False, h)
                         for i, h in enumerate(hints)]
                docs = run_jobs(argvs, env, logdir, a.job_timeout, together=True, cpus=a.cpus)
                from benchmarks.gpu_timeslice import agent_ops
                ops = agent_ops(agent)
                profiles = _profiles(lockd.replicas[0].target)
            finally:
                agent.stop()
                lockd.stop()
    finally:
        dev.release()
    res = F.regime_figures(docs)
    cap = {f"{NODE}/0": fit["simulated_capacity_bytes"]} if "simulated_capacity_bytes" in fit else None
    res.update(regime=regime, fit=fit, swap=F.swap_figures(ops, docs), degradation=F.degradation(docs, alone),
               agent_ops=ops, hints_bytes=hints, exit_codes=[0] * len(docs), sharing=F.sharing_figures(docs, cap))
    res["timeline"] = T.timeline(docs, alone)      # the order the jobs ran in, their waits, what ran beside
    res["pins"] = {d["job"]: d.get("pin") for d in docs}
    res["dense"] = {d["job"]: d.get("dense") for d in docs}
    try:                                           # advise's prediction of this group, from this regime's profiles
        res["advice"] = D.advice(profiles, docs, alone) if profiles is not None else {"error": "no profiles"}
    except Exception as e:  # a figure, not the run: say why it is missing
        res["advice"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return res


def _profiles(target: str):
    """lockd's profiles of the regime's jobs (None where it cannot say)."""
    from timeslice import OrchestratorClient
    try:
        with OrchestratorClient(target=target, job_id="admin") as admin:
            return admin.profiles()
    except Exception:  # best effort: the advice figure says it is missing
        return None


def no_lock(a, dev: Device, alone: list[dict], logdir: Path, fit: dict) -> dict:
    """The N jobs started together with no timeslice (``--standalone``, at once): where they fit."""
    logdir.mkdir()
    argvs = [job_argv(a, i + 1, logdir / f"{job_id(i)}.json", "cooperative", True) for i in range(len(alone))]
    docs = run_jobs(argvs, {}, logdir, a.job_timeout, together=True, cpus=a.cpus)
    res = F.regime_figures(docs)
    res.update(regime="nolock", fit=fit, degradation=F.degradation(docs, alone), exit_codes=[0] * len(docs))
    return res


def fits_together(a, dev: Device, alone: list[dict]) -> dict:
    """Whether the N jobs fit the device side by side with no lock (else the nolock regime is skipped:
    they would run out of memory). The dry run's standalone jobs hold no device memory: there it is
    the mix that says."""
    if a.dry_run:
        return {"fits_side_by_side": a.mix == "fits", "fit_at_once": fitting(a)}
    free = dev.sampler.free_bytes()
    need = sum(d.get("peak_bytes", 0) for d in alone) + len(alone) * int(a.context_gib * GiB) + GiB
    return {"fits_side_by_side": a.mix == "fits" and need <= free, "free_gib": round(free / GiB, 2),
            "need_gib": round(need / GiB, 2)}


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
                   help="give each job its share of the physical cores (its own cpuset), standalone runs too")
    p.add_argument("--jobs", type=int, default=2, help="how many jobs (seeds 1..N; default 2: the pair)")
    p.add_argument("--mix", default="", metavar="MIX[,MIX]",
                   help=f"{'|'.join(MIXES)}, or several comma-separated (one standalone baseline for all): size "
                        "the device so that all, half or one of the jobs fit at once, and run some of the regimes "
                        f"{','.join(MIX_REGIMES)} (default per mix: "
                        + "; ".join(f"{m}: {','.join(r)}" for m, r in MIX_DEFAULTS.items()) + ")")
    p.add_argument("--generation", choices=("dense", "eager"), default="eager",
                   help="how the jobs generate: eager (transformers' generate; default) or dense (static KV "
                        "cache, CUDA-graph decode; not yet proven on a GPU: benchmarks/results/gpu_round4.md): "
                        "the standalone duty before/after")
    p.add_argument("--profile", default="", choices=[""] + sorted(PROFILES),
                   help="the jobs' size and phases (default: full; --quick, --dry-run, --kind plain and --mix pick theirs)")
    a = p.parse_args(argv)
    a.mixes = [m for m in a.mix.split(",") if m]
    if any(m not in MIXES for m in a.mixes):
        p.error(f"--mix: {'|'.join(MIXES)}, comma-separated")
    if not 1 <= a.jobs <= 26 or (not a.mixes and a.jobs != 2):
        p.error("--jobs: 1..26, and other than 2 only with --mix")
    a.mix = a.mixes[0] if a.mixes else ""     # the mix being run (set per mix below)
    a.cpus = core_parts(a.jobs) if a.split_cores else None
    a.profile = dict(PROFILES[a.profile or ("dry-run" if a.dry_run else "plain-7b" if a.kind == "plain" else
                                            "quick" if a.quick else "mix" if a.mixes else "full")])
    if a.kind == "plain" and a.dry_run:
        a.profile["batch"] = 8
    a.regimes = a.regimes or ("" if a.mixes else ",".join(REGIMES) if a.kind == "trl" else "standalone,cooperative")
    if a.steps:
        a.profile["steps"] = a.steps
    if a.reward_s:
        a.profile["reward_s"] = a.reward_s
    name = a.name or "gpu_rl_real" + ("_plain" if a.kind == "plain" else "") + (
        f"_{'-'.join(a.mixes)}{a.jobs}" if a.mixes else "") + ("_dryrun" if a.dry_run else "_quick" if a.quick else "")
    asked = [r for r in a.regimes.split(",") if r and r != "standalone"]
    # (key in the document, mix, regime), after the standalone baseline (the degradation reference), run once
    runs = [(f"{m}/{r}", m, r) for m in a.mixes for r in (asked or MIX_DEFAULTS[m])] if a.mixes else \
        [(r, "", r) for r in asked]
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

    def conclude() -> str:
        """Ratios against nolock and the targets over the regimes run so far, the document and the
        table written: after every regime, so that a run cut short (``timeout``) keeps its figures."""
        for key, r in doc["regimes"].items():
            nolock = doc["regimes"].get(f"{r.get('mix')}/nolock") if r.get("mix") else doc["regimes"].get("nolock")
            if nolock and "wall_s" in nolock and "wall_s" in r and r is not nolock and key != "standalone":
                r["vs_no_lock"] = F.vs(r, nolock)
                r["wall_vs_no_lock"] = r["vs_no_lock"]["wall"]
        if a.mixes:
            doc["targets"] = targets(doc, a.mixes) + D.targets(doc, a.kind)
        text = report(doc)
        with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
            f.write(text + "\n")
        save()
        return text

    (workdir / "standalone").mkdir()
    argvs = [job_argv(a, i + 1, workdir / "standalone" / f"{job_id(i)}.json", "cooperative", True)
             for i in range(a.jobs)]
    try:
        alone = run_jobs(argvs, {}, workdir / "standalone", a.job_timeout * a.jobs, together=False, cpus=a.cpus)
    except JobsFailed as e:
        doc["regimes"]["standalone"] = {"regime": "standalone", "error": str(e)[-2000:], "exit_codes": e.exit_codes}
        doc["ok"] = False
        save()
        print(f"FAILED: a standalone job died (exit codes {e.exit_codes}); no ratio means anything")
        return 1
    base = F.regime_figures(alone, sequential=True)
    base.update(regime="standalone", sequential=True, exit_codes=[0] * len(alone),
                dense={f"{d['job']}-{i}": d.get("dense") for i, d in enumerate(alone)})
    add_nvml(base, dev)
    doc["regimes"]["standalone"] = base
    save()
    failed = []
    for key, mix, regime in runs:
        a.mix = mix
        where = key.replace("/", "-")
        try:
            if regime == "nolock":
                together = fits_together(a, dev, alone)
                if not together["fits_side_by_side"]:
                    doc["regimes"][key] = {"regime": regime, "mix": mix, "fit": together, "skipped": (
                        f"the {a.jobs} jobs do not fit the device side by side (--mix {mix}): "
                        "started together with no lock they would run out of memory")}
                    save()
                    continue
                res = no_lock(a, dev, alone, workdir / where, together)
            else:
                res = sliced(a, dev, regime, alone, workdir, where)
            add_nvml(res, dev)
            res["vs_standalone"] = F.ratios(res, base)
            if a.mixes:
                res["density"] = D.figures(res, base, a.jobs)
            res["mix"] = mix
        except Exception as e:   # keep the other regimes' figures: the failure is a result too
            res = {"regime": regime, "mix": mix, "error": f"{type(e).__name__}: {str(e)[-2000:]}",
                   "exit_codes": getattr(e, "exit_codes", None),
                   "logs": keep_logs(workdir / where, Path(a.out) / f"{name}_{where}_logs.tar.gz")}
            failed.append(key)
        doc["regimes"][key] = res
        doc["partial"] = True                 # until every regime asked for has run
        conclude()
    if dev.sampler is not None:
        dev.sampler.stop.set()
    doc.pop("partial", None)
    print(conclude())
    ran = {k: r for k, r in doc["regimes"].items() if k != "standalone" and "skipped" not in r}
    ok = not failed and all(all(v["losses_identical"] and v["weights_identical"] for v in r["degradation"].values())
                            for r in ran.values())
    doc["ok"] = ok
    save()
    return 0 if ok else 1


def size(n: int) -> str:
    """Bytes as GiB, or MiB where under a GiB (the dry run's simulated sizes)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def targets(doc: dict, mixes: list[str]) -> list[dict]:
    """The fit policy's targets (TARGETS) against this run's figures: each with its value and verdict
    (None: the regimes it needs did not run, or one of them failed)."""
    out = []
    for mix in mixes:
        for regime, what, op, bound in TARGETS[mix]:
            r = doc["regimes"].get(f"{mix}/{regime}", {})
            ref = {"wall_vs_no_lock": f"{mix}/nolock", "nvml_vs_no_lock": f"{mix}/nolock",
                   "wall_vs_standalone": "standalone", "wall_vs_exclusive": f"{mix}/exclusive"}[what]
            b = doc["regimes"].get(ref, {})
            value = None
            if "wall_s" in r and "wall_s" in b and not r.get("error") and not b.get("error"):
                if what.startswith("wall"):
                    value = round(r["wall_s"] / b["wall_s"], 3)
                elif r.get("duty_cycle_nvml") is not None and b.get("duty_cycle_nvml"):
                    value = round(r["duty_cycle_nvml"] / b["duty_cycle_nvml"], 3)
            ok = None if value is None else (value <= bound if op == "<=" else value >= bound)
            out.append({"mix": mix, "what": what, "value": value, "target": f"{op} {bound}", "ok": ok})
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def report(doc: dict) -> str:
    if doc["params"].get("mixes"):
        return mix_report(doc)
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
    # Each sliced job's memory as the lock was told it (README, "Memory a grant admits"), and what it
    # declared: the per-job context and residue of this device, in the JSON too.
    mem = [f"{name}: {j['job']} declared {size(r['hints_bytes'][i])}, measured peak "
           f"{size(j['measured'].get('peak', 0))}, context {size(j['measured'].get('context', 0))}, "
           f"residue after each pause [{', '.join(map(size, j['residue_bytes']))}]"
           for name, r in doc["regimes"].items() if name != "standalone" and "jobs" in r and "hints_bytes" in r
           for i, j in enumerate(r["jobs"])]
    lines = [f"{name}:\n{T.text(r['timeline'])}" for name, r in doc["regimes"].items() if "timeline" in r]
    return "\n".join([table(head, rows) + f"\n{note}; ratios (x) against standalone, same run", *mem, *lines])


def _bit_equal(r: dict) -> str:
    deg = r.get("degradation", {})
    return "yes" if deg and all(v["losses_identical"] and v["weights_identical"] for v in deg.values()) else (
        "-" if not deg else "NO")


def mix_report(doc: dict) -> str:
    """--jobs N --mix: wall against one after the other and against nolock, NVML, the overlap of holds,
    exit codes and bit-identity; FAILED (no ratio) for a regime in which a job died."""
    rows, notes = [], []
    for name, r in doc["regimes"].items():
        # Why a regime failed or was skipped goes below the table (a column that wide reads badly).
        if "error" in r:
            rows.append([name, "FAILED"] + [""] * 10 + [",".join(str(c) for c in r.get("exit_codes", []))] + [""])
            notes.append(f"{name}: FAILED (exit codes {r.get('exit_codes')}): " + r["error"].splitlines()[0][:200])
            continue
        if "skipped" in r:
            rows.append([name, "skipped"] + [""] * 11)
            notes.append(f"{name}: skipped: {r['skipped']}")
            continue
        sh, ratio, nl = r.get("sharing") or {}, r.get("vs_standalone", {}), r.get("vs_no_lock") or {}
        rows.append([name, r["wall_s"], ratio.get("wall", 1.0) if name != "standalone" else 1.0,
                     nl.get("wall", "-"), pct(r.get("duty_cycle_nvml")), nl.get("duty_cycle_nvml", "-"),
                     pct(r["duty_cycle_phases"]), sh.get("max_holders", "-"), sh.get("holds_beside_another", "-"),
                     sh.get("backfilled", "-"),
                     "/".join(f"{ratio.get(j['job'], {}).get('tokens_per_s') or 1:.2f}" for j in r["jobs"]),
                     ",".join(str(c) for c in r.get("exit_codes", [])), _bit_equal(r)])
    head = ["regime", "wall s", "x seq", "x no-lock", "NVML", "NVML x no-lock", "phases", "max holders",
            "beside", "backfilled", "tok/s x", "exit", "bit-equal"]
    p = doc["params"]
    note = ("SIMULATED device (CPU dry run): no NVML" if doc["simulated"]
            else "NVML duty: share of 50 ms samples a kernel ran, over each regime's window")
    lines = [table(head, rows), f"{p['jobs']} jobs, --mix {','.join(p['mixes'])}; {note}; x seq: wall against one "
             "after the other (standalone), x no-lock: against the jobs started together with no lock", *notes]
    for t in doc.get("targets", []):
        verdict = "-" if t["ok"] is None else ("met" if t["ok"] else "MISSED")
        lines.append(f"target {t['mix']}: {t['what']} {t['value']} (wanted {t['target']}): {verdict}")
    lines += D.text(doc)
    lines += [f"{name}:\n{T.text(r['timeline'])}" for name, r in doc["regimes"].items() if "timeline" in r]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
