"""Proof on a real GPU: JAX jobs time-sliced, by checkpoint and cooperatively, and a JAX job beside a PyTorch TRL job.

Runs benchmarks/gpu_jax_job.py (plain JAX: generate, a CPU reward outside the hold, a policy-gradient
step with a hand-written Adam) and examples/grpo/trl_job.py (TRL's GRPOTrainer, as
benchmarks/gpu_rl_real.py drives it), each first alone, one after the other (the baseline and the
bit-equality reference of the same run), then in one group through lockd and the node agent:

  jax-checkpoint   two JAX jobs; the agent checkpoints the parked process (CUDA driver API):
                   no change to the JAX loop; >= 3 swaps, both bit-identical to their standalone runs
  jax-cooperative  the same two jobs, each pausing its own state (``JaxMemory``): the round trip of
                   the two paths compared, from the agent's own timings
  mixed            one JAX job (cooperative) and one TRL job (cooperative, torch-memory-saver)

Each sliced regime gets a fresh etcd, lockd and node agent, and the pair must not fit side by side
(gpu_rl_real's ballast rule). Figures per regime (rl_real_figures.py): NVML duty cycle (the headline)
against one after the other, each job's steps, swaps and GPU-phase throughput, the swap round trip
and bytes per swap, the residue after a pause, the degradation check (losses and final weights
bit-identical to standalone), and every job's exit code: a regime in which a job died is FAILED,
with no ratio.

    python -m benchmarks.gpu_jax_pair --out $OUT               # the H200 (~5 min)
    python -m benchmarks.gpu_jax_pair --dry-run --out /tmp/x   # CPU, SIMULATED device (CI)

``--dry-run``: JAX's CPU backend and the SIMULATED device (``SimJaxMemory``: a pause deletes the
arrays, so a phase run outside its hold fails; the checkpoint regime gives each JAX job a simulated
arena of its state's size for the agent to move), the sim agent; a tiny model; no NVML.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import rl_real_figures as F
from benchmarks.common import machine_facts, table
from benchmarks.gpu_rl_real import PROFILES as TRL_PROFILES
from benchmarks.gpu_rl_real import Device, keep_logs
from benchmarks.gpu_rl_real import job_argv as trl_argv

ROOT = Path(__file__).resolve().parents[1]
NODE = "gpu-node-0"
GiB = 1 << 30
REGIMES = ("jax-cooperative", "jax-checkpoint", "mixed")
JAX_PROFILES = {
    # ~2.0 GiB of parameters and Adam state per job; per step ~1 s of GPU work on the H200 (estimated)
    "full": dict(steps=3, batch=128, generations=8, seq_len=128, vocab=8192, dim=1024, hidden=4096, layers=8,
                 reward_s=2.0, lr=1e-4),
    "dry-run": dict(steps=2, batch=8, generations=4, seq_len=8, vocab=64, dim=16, hidden=32, layers=2,
                    reward_s=0.3, lr=1e-2),
}


def jax_argv(a, seed: int, out: Path, swap: str, standalone: bool, hint: int = 0) -> list[str]:
    p = a.jax_profile
    argv = [sys.executable, "-m", "benchmarks.gpu_jax_job", "--out", str(out), "--seed", str(seed),
            "--device", "cpu" if a.dry_run else "gpu", "--swap", swap, "--group", "gpu", "--hint-bytes", str(hint)]
    for k, v in p.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv + (["--standalone"] if standalone else [])


def run_jobs(argvs: list[list[str]], env: dict, logdir: Path, timeout: float, together: bool) -> tuple[list, list]:
    """Run the jobs (at once, or one after the other); (their documents or None, their exit codes)."""
    procs = []
    if together:      # their loops start together, whatever their imports cost
        env = {**env, "TIMESLICE_EXAMPLE_BARRIER": f"{logdir / 'barrier'}:{len(argvs)}"}
    end = time.monotonic() + timeout
    for i, argv in enumerate(argvs):
        with open(logdir / f"job-{i}.log", "wb") as log:     # the child keeps its own descriptor
            procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **env, "TIMESLICE_JOB_ID": f"job-{'abc'[i]}"}))
        if not together:
            _wait(procs[-1], end)
    for p in procs:
        _wait(p, end)
    docs = []
    for argv, p in zip(argvs, procs):
        out = Path(argv[argv.index("--out") + 1])
        docs.append(json.loads(out.read_text()) if p.returncode == 0 and out.exists() else None)
    return docs, [p.returncode for p in procs]


def _wait(p: subprocess.Popen, end: float) -> None:
    try:
        p.wait(max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def preflight(dry_run: bool) -> dict:
    """On a GPU: whether this XLA takes the job's determinism flags (an unknown flag aborts XLA)."""
    if dry_run:
        return {}
    from benchmarks.gpu_jax_job import GPU_XLA_FLAGS
    code = "import jax, jax.numpy as j; print(jax.__version__, jax.devices()[0].platform, float(j.ones(4).sum()))"
    env = {**os.environ, "XLA_FLAGS": GPU_XLA_FLAGS, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    out = {"xla_flags": GPU_XLA_FLAGS, "ok": p.returncode == 0, "answer": p.stdout.strip()[-200:]}
    if p.returncode != 0:
        out["error"] = p.stderr[-600:]
        os.environ["TIMESLICE_JAX_XLA_FLAGS"] = ""          # run without them, and say so
    return out


def pairs(a, alone: dict) -> dict:
    """regime -> [(kind, seed, standalone document)], in job order."""
    ja, jb, trl = alone["jax-a"], alone["jax-b"], alone["trl"]
    return {"jax-cooperative": [("jax", 1, ja), ("jax", 2, jb)], "jax-checkpoint": [("jax", 1, ja), ("jax", 2, jb)],
            "mixed": [("jax", 1, ja), ("trl", 1, trl)]}


def argv_of(a, kind: str, seed: int, out: Path, swap: str, standalone: bool, hint: int = 0) -> list[str]:
    if kind == "jax":
        return jax_argv(a, seed, out, swap, standalone, hint)
    return trl_argv(a.trl, seed, out, swap, standalone, hint)


def sliced(a, dev: Device, regime: str, jobs: list[tuple], workdir: Path) -> dict:
    from benchmarks.gpu_timeslice import agent_ops
    from timeslice import OrchestratorClient
    from timeslice.testing.agent import AgentProcess
    from timeslice.testing.etcd import EtcdCluster
    from timeslice.testing.lockd import LockdCluster
    logdir = workdir / regime
    logdir.mkdir()
    alone = [d for _, _, d in jobs]
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
                    admin.create_group("gpu", nodes=[NODE])
                swap = "checkpoint" if regime == "jax-checkpoint" else "cooperative"
                # Each job tells lockd its peak (measured standalone, same run), as a user would.
                hint = lambda d: d.get("peak_bytes", 0) + (0 if a.dry_run else int(a.context_gib * GiB))  # noqa: E731
                argvs = [argv_of(a, k, s, logdir / f"{k}-{s}.json", swap, False, hint(d)) for k, s, d in jobs]
                docs, codes = run_jobs(argvs, env, logdir, a.job_timeout, together=True)
                ops = agent_ops(agent)
            finally:
                agent.stop()
                lockd.stop()
    finally:
        dev.release()
    res: dict = {"regime": regime, "fit": fit, "exit_codes": codes, "agent_ops": ops}
    if any(c != 0 for c in codes):
        res["error"] = f"job exit codes {codes}"
        res["logs"] = keep_logs(logdir, Path(a.out) / f"{a.name}_{regime}_logs.tar.gz")
        return res
    res.update(F.regime_figures(docs))
    res.update(swap=F.swap_figures(ops, docs), degradation=F.degradation(docs, alone),
               swaps_per_job={d["job"]: sum(bool(h["restored"]) for h in F.holds(d)) for d in docs},
               left_behind={d["job"]: d.get("left_behind") for d in docs},
               backup={d["job"]: d.get("backup") for d in docs},
               first_pin={d["job"]: d["first_pin"] for d in docs if d.get("first_pin")})
    return res


def pins_outside_holds(doc: dict) -> list[str]:
    """The cooperative JAX jobs whose host backup was not all reserved before their first hold."""
    bad = []
    for name, r in doc["regimes"].items():
        for job, pin in (r.get("first_pin") or {}).items():
            state = next((j for j in r["jobs"] if j["job"] == job), {}).get("region_bytes", {})
            if not pin["outside_any_hold"] or pin["host_bytes"] < sum(state.values()):
                bad.append(f"{name}/{job}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, SIMULATED device (what CI runs)")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--steps", type=int, default=0, help="override the JAX profile's steps per job")
    p.add_argument("--trl-steps", type=int, default=0, help="override the TRL profile's steps")
    p.add_argument("--job-timeout", type=float, default=300, help="per regime, s")
    p.add_argument("--ballast", type=int, default=1, help="1: hold the difference where the pair would fit")
    p.add_argument("--context-gib", type=float, default=0.75, help="CUDA context beside a job's peak")
    p.add_argument("--coop-residue-gib", type=float, default=1.5,
                   help="room left for a parked cooperative job's residue when sizing the ballast")
    p.add_argument("--name", default="", help="file name stem (default gpu_jax_pair[_dryrun])")
    a = p.parse_args(argv)
    a.jobs, a.mix, a.mixes = 2, "", []       # gpu_rl_real's pair mode (its Device sizes the ballast by them)
    a.jax_profile = dict(JAX_PROFILES["dry-run" if a.dry_run else "full"])
    if a.steps:
        a.jax_profile["steps"] = a.steps
    trl_profile = dict(TRL_PROFILES["dry-run" if a.dry_run else "quick"])
    if a.trl_steps:
        trl_profile["steps"] = a.trl_steps
    a.trl = argparse.Namespace(profile=trl_profile, kind="trl", dry_run=a.dry_run, dtype="float32", lr=1e-5,
                               generation="eager")
    a.name = a.name or "gpu_jax_pair" + ("_dryrun" if a.dry_run else "")
    regimes = [r for r in a.regimes.split(",") if r]
    unknown = sorted(set(regimes) - set(REGIMES))
    if unknown:
        p.error(f"unknown regimes {unknown}; known: {REGIMES}")
    os.makedirs(a.out, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-jax-pair-"))
    if a.dry_run:
        # One compilation of each jitted step for all the runs (XLA's persistent cache, shared through the
        # environment): the same program either way, and CPU seconds CI does not have. The GPU run
        # compiles in every job, so that standalone and sliced pay alike.
        for k, v in (("JAX_COMPILATION_CACHE_DIR", str(workdir / "jax-cache")),
                     ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                     ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")):
            os.environ.setdefault(k, v)
    t_start = time.monotonic()
    doc: dict = {"benchmark": a.name, "command": "python -m benchmarks.gpu_jax_pair " + " ".join(sys.argv[1:]),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine_facts(), "simulated": a.dry_run, "jax_profile": a.jax_profile,
                 "trl_profile": trl_profile, "preflight": preflight(a.dry_run), "regimes": {}}

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
        with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)

    dev = Device(a.dry_run, workdir)
    (workdir / "standalone").mkdir()
    need_trl = "mixed" in regimes
    names = ["jax-a", "jax-b"] + (["trl"] if need_trl else [])
    kinds = {"jax-a": ("jax", 1), "jax-b": ("jax", 2), "trl": ("trl", 1)}
    argvs = [argv_of(a, *kinds[n], workdir / "standalone" / f"{n}.json", "cooperative", True) for n in names]
    docs, codes = run_jobs(argvs, {}, workdir / "standalone", a.job_timeout * 2, together=False)
    doc["standalone_exit_codes"] = dict(zip(names, codes))
    failed: list[str] = []
    if any(c != 0 for c in codes):
        doc["regimes"]["standalone"] = {"error": f"job exit codes {codes}",
                                        "logs": keep_logs(workdir / "standalone", Path(a.out) / f"{a.name}_standalone_logs.tar.gz")}
        failed.append("standalone")
        regimes = []
    else:
        alone = dict(zip(names, docs))
        if not need_trl:
            alone["trl"] = {}
        for regime in regimes:
            jobs = pairs(a, alone)[regime]
            base = F.regime_figures([d for _, _, d in jobs], sequential=True)
            base.update(regime="one after the other", sequential=True)
            from benchmarks.gpu_rl_real import add_nvml
            add_nvml(base, dev)
            try:
                res = sliced(a, dev, regime, jobs, workdir)
                if "error" not in res:
                    add_nvml(res, dev)
                    res["vs_one_after_the_other"] = F.ratios(res, base)
                    res["one_after_the_other"] = {k: base[k] for k in ("wall_s", "duty_cycle_nvml", "duty_cycle_phases")}
            except Exception as e:   # keep the other regimes' figures: the failure is a result too
                res = {"regime": regime, "error": f"{type(e).__name__}: {str(e)[-2000:]}",
                       "logs": keep_logs(workdir / regime, Path(a.out) / f"{a.name}_{regime}_logs.tar.gz")}
            if "error" in res:
                failed.append(regime)
            doc["regimes"][regime] = res
            save()
    if dev.sampler is not None:
        dev.sampler.stop.set()
    doc["round_trip"] = round_trips(doc)
    ok = not failed and all(all(v["losses_identical"] and v["weights_identical"] for v in r["degradation"].values())
                            for r in doc["regimes"].values())
    ck = doc["regimes"].get("jax-checkpoint")
    if ck and "error" not in ck and ck["swap"]["swaps"] < 3:
        ok = False
        doc["short_of_swaps"] = f"the checkpoint regime swapped {ck['swap']['swaps']} times (>= 3 asked)"
    late = pins_outside_holds(doc)
    if late:
        ok = False
        doc["pinned_inside_a_hold"] = late
    doc["ok"] = ok
    save()
    text = report(doc)
    print(text)
    with open(os.path.join(a.out, f"{a.name}.txt"), "w") as f:
        f.write(text + "\n")
    shutil.rmtree(workdir, ignore_errors=True)         # a failed regime's logs were kept in --out
    return 0 if ok else 1


def round_trips(doc: dict) -> dict:
    """The steady swap round trip of the checkpoint path against the cooperative one (the agent's timings)."""
    get = lambda r: (doc["regimes"].get(r) or {}).get("swap", {}).get("round_trip_steady_median_s")  # noqa: E731
    ck, co = get("jax-checkpoint"), get("jax-cooperative")
    out = {"checkpoint_s": ck, "cooperative_s": co}
    if ck and co:
        out["checkpoint_over_cooperative"] = round(ck / co, 2)
    return out


def pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def report(doc: dict) -> str:
    head = ["regime", "wall s", "wall x", "NVML", "NVML seq", "phases", "steps", "swaps", "trip s", "GiB/swap",
            "residue GiB", "exit", "bit-equal"]
    rows = []
    for name, r in doc["regimes"].items():
        if "error" in r:
            rows.append([name, "FAILED: " + r["error"].splitlines()[0][:80]] + [""] * (len(head) - 2))
            continue
        ratio = r.get("vs_one_after_the_other", {})
        deg, sw = r.get("degradation", {}), r.get("swap", {})
        rows.append([name, r["wall_s"], ratio.get("wall", "-"), pct(r.get("duty_cycle_nvml")),
                     pct(r["one_after_the_other"].get("duty_cycle_nvml")), pct(r["duty_cycle_phases"]),
                     "/".join(str(j["steps"]) for j in r["jobs"]), sw.get("swaps", 0),
                     sw.get("round_trip_steady_median_s") or "-", sw.get("gib_per_swap", "-"),
                     f"{sw.get('residue_gib_max', 0):.2f}",
                     "/".join(str(c) for c in r["exit_codes"]),
                     "yes" if deg and all(v["losses_identical"] and v["weights_identical"] for v in deg.values())
                     else "NO"])
    note = ("SIMULATED device (CPU dry run): no NVML; swaps are the simulator's" if doc["simulated"]
            else "NVML duty: share of 50 ms samples a kernel ran; seq: the same jobs one after the other, same run")
    rt = doc.get("round_trip", {})
    pins = [f"{name}/{job} {p['s']} s for {p['host_bytes'] / GiB:.2f} GiB, "
            f"{'outside any hold' if p['outside_any_hold'] else 'NOT before the first hold'}"
            for name, r in doc["regimes"].items() for job, p in (r.get("first_pin") or {}).items()]
    if pins:
        note += "\nfirst pin (cooperative JAX jobs, at registration): " + "; ".join(pins)
    return (table(head, rows) + f"\n{note}\nround trip, checkpoint {rt.get('checkpoint_s')} s against cooperative "
            f"{rt.get('cooperative_s')} s (x{rt.get('checkpoint_over_cooperative', '-')}); ok: {doc.get('ok')}")


if __name__ == "__main__":
    raise SystemExit(main())
