"""Proof on a multi-GPU host: two jobs, one process per GPU each, NCCL all-reduce in every GPU
phase, time-sliced through lockd + one node agent.

    python -m benchmarks.gpu_multi --out "$OUT"            # 2×H200: both GPUs, all regimes
    python -m benchmarks.gpu_multi --gpus 2 --regimes nofit --iters 3

Starts etcd, lockd and one node agent (CUDA driver backend), creates a group
over the node's GPUs, then runs two jobs. A job is a launcher process (it
holds the job's session: ``OrchestratorClient``) and one *rank* process per
GPU (its children, registered by the launcher with ``gpus=[rank]``); the
ranks form a torch.distributed NCCL group. Every GPU phase (generate, train)
runs under ``on_accelerators(group)`` on every rank: the weights' checksum is
verified (a restore that lost a byte is caught), matmuls run for the phase's
length, and an all-reduce checks its result (a broken communicator hangs:
the launcher's deadline catches it). Rewards run on the CPU, GPUs untouched.

Regimes:
  standalone          each job alone, one after the other, no lock (the baseline duty cycle)
  fit                 both jobs fit side by side on every GPU: handoffs elided
  nofit               a ballast process per GPU leaves room for one job: every handoff
                      checkpoints the resident job's ranks (all GPUs in parallel) and
                      restores the other's
  collective-refused  job A registers its ranks collective=True with swap=checkpoint: the
                      agent must refuse to checkpoint them (B's Acquire fails with the reason)
                      and A's all-reduce stays correct

With the checkpoint backend the ranks run NCCL checkpoint-safe
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0; README "Collective
jobs"), except in collective-refused. Writes ``gpu_multi.json`` and
``gpu_multi.txt`` (the table) under --out (default $OUT, else benchmarks/results).
Measured: duty cycle standalone vs sliced, per-GPU swap times (the agent's
per-process op times mapped to GPUs), refused restores, all-reduce and checksum
after every restore, token order.

Without a GPU, ``--sim`` runs the same pipeline on SIMULATED GPUs (real bytes,
per-GPU capacity; the all-reduce is a loopback TCP sum done inside a device
operation) — a dry run of the plumbing, not a measurement. NCCL without p2p and
shm talks over sockets: set NCCL_SOCKET_IFNAME (e.g. ``lo``) if the host has no
usable interface. The job and rank processes are ``benchmarks/gpu_multi_job.py``.

Import-safe: torch, pynvml and the cluster harness are imported only when run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.gpu_multi_job import ENV_BARRIER
from benchmarks.gpu_timeslice import load, wait_jobs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NODE = "gpu-node-0"
GROUP = "gpus"
GB = 1 << 30
NCCL_SAFE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}  # = gpu_multi_job's
REGIMES = ("fit", "nofit", "collective-refused")


# ============================ driver ======================================================================

class GpuSampler(threading.Thread):
    """Utilisation and used memory of every GPU, every 50 ms (NVML)."""

    def __init__(self, n: int):
        super().__init__(daemon=True)
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        self.samples: list[tuple[float, list[int]]] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.hs]))
            time.sleep(0.05)

    def mean_util(self, t0: float, t1: float) -> list[float]:
        xs = [u for t, u in self.samples if t0 <= t <= t1]
        return [round(sum(col) / len(col) / 100, 3) for col in zip(*xs)] if xs else []

    def free(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).free for h in self.hs]


def job_cmd(a, job: str, mode: str, events: str, target: str = "", collective: int = 0, nccl_safe: int = 1,
            hint: int = 0, sim_dir: str = "") -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu_multi", "--role", "job", "--job", job, "--mode", mode,
            *(["--sim-dir", sim_dir] if sim_dir else []),
            "--events", events, "--target", target, "--gpus", str(a.gpus), "--iters", str(a.iters),
            "--gen-s", str(a.gen_s), "--reward-s", str(a.reward_s), "--train-s", str(a.train_s),
            "--mem-gb", str(a.mem_gb), "--scratch-gb", str(a.scratch_gb), "--seed", str(1 + (job == "job-b")),
            "--collective", str(collective), "--nccl-safe", str(nccl_safe), "--hint-bytes", str(hint),
            "--phase-timeout", str(a.phase_timeout), "--release-cache", str(a.release_cache)]


def analyse(events: list[dict], label: str, sampler: GpuSampler | None) -> dict:
    from timeslice.lockd.report.figures import union_length
    gpu = sorted((e for e in events if e["ev"] == "phase" and e.get("gpu")), key=lambda e: e["start"])
    res = {"label": label, "gpu_phases": len(gpu), "violations": [],
           "acquire_failed": sorted({e["error"][:400] for e in events if e["ev"] == "acquire_failed"}),
           "acquire_failures": sum(1 for e in events if e["ev"] == "acquire_failed"),
           "errors": [e["error"] for e in events if e["ev"] in ("error", "hung")]}
    if not gpu:
        res["violations"].append("no GPU phase completed")
        return res
    t0 = min(e.get("t_req", e["start"]) for e in events if e["ev"] == "phase")
    t1 = max(e["end"] for e in events if e["ev"] == "phase")
    busy = union_length([(e["start"], e["end"]) for e in gpu])
    for x, y in zip(gpu, gpu[1:]):
        if y["start"] < x["end"] and x["job"] != y["job"] and not (x.get("elided") or y.get("elided")):
            res["violations"].append(f"overlap without elision: {x['job']} {x['phase']} / {y['job']} {y['phase']}")
    toks = [e["token"] for e in gpu if e.get("token")]
    if any(b < a for a, b in zip(toks, toks[1:])):
        res["violations"].append(f"tokens not increasing: {toks}")
    for key, what in (("checksum_ok", "weights checksum"), ("allreduce_ok", "all-reduce result")):
        bad = [e for e in gpu if not e[key]]
        if bad:
            res["violations"].append(f"{len(bad)} phases with a wrong {what}")
    if res["errors"]:
        res["violations"].extend(res["errors"])
    restored = [e for e in gpu if e.get("restored")]
    res.update(wall_s=round(t1 - t0, 2), gpu_busy_s=round(busy, 2), duty_cycle=round(busy / (t1 - t0), 3),
               nvml_util_per_gpu=sampler.mean_util(t0, t1) if sampler else [],
               restored_phases=len(restored), allreduce_checked_after_restore=sum(e["allreduce_ok"] for e in restored),
               elided=sum(1 for e in gpu if e.get("elided")), bytes_moved=sum(e.get("bytes_moved", 0) for e in gpu),
               wait_s=round(sum(e.get("waited_ms", 0) for e in gpu) / 1000, 2),
               allreduce_ms_max=max(e["allreduce_ms"] for e in gpu))
    return res


def swap_times(agent, events: list[dict]) -> dict:
    """Per-GPU checkpoint/restore seconds from the agent's per-process op log, and refusals."""
    gpu_of = {}
    for e in events:
        if e["ev"] == "ranks":
            gpu_of.update({int(p): g for p, g in e["pids"].items()})
    per_gpu: dict[str, dict[str, list[float]]] = {}
    for name, op in (("snapshot_done", "checkpoint"), ("restore_done", "restore")):
        for e in agent.events(name):
            for p in e.get("per_pid", []):
                if p["outcome"] == "done" and p["pid"] in gpu_of:
                    per_gpu.setdefault(f"gpu{gpu_of[p['pid']]}", {}).setdefault(op, []).append(p["ms"] / 1000)
    job_ops = agent.events("op_done")
    # Refused before running (intent_refused: stale token, a collective job) or by admission (op_done).
    refused = [(e.get("op"), e.get("reason") or "") for e in agent.events("intent_refused")]
    refused += [(e.get("op"), e.get("error") or "") for e in job_ops if e.get("outcome") == "refused"]
    return {"per_gpu_s": {g: {op: {"n": len(xs), "mean": round(sum(xs) / len(xs), 3), "max": round(max(xs), 3)}
                              for op, xs in ops.items()} for g, ops in sorted(per_gpu.items())},
            "job_ops": len(job_ops),
            "job_op_s": round(sum(e.get("elapsed_ms", 0) for e in job_ops) / 1000, 2),
            "refused_restores": sum(1 for op, _ in refused if op == "restore"),
            "refused_snapshots": sum(1 for op, _ in refused if op == "snapshot"),
            "refusal_reasons": sorted({why[:300] for _, why in refused})}


def sim_device(a, workdir: str, name: str, capacity: int) -> tuple[str, dict]:
    """A SIMULATED node of ``a.gpus`` GPUs of ``capacity`` bytes each (--sim dry runs)."""
    from timeslice.common.sim.device import SimDevice
    d, host = os.path.join(workdir, f"sim-{name}"), os.path.join(workdir, f"host-{name}")
    SimDevice(d, host, capacity_bytes=capacity, gpus=a.gpus)
    return d, {"TIMESLICE_SIM_HOST_DIR": host}


def unit(a) -> int:
    """What --mem-gb counts: GiB on GPUs, MiB on the simulator."""
    return (1 << 20) if a.sim else GB


def run_standalone(a, sampler, workdir: str) -> dict:
    ev = os.path.join(workdir, "standalone.jsonl")
    sim_dir, env = sim_device(a, workdir, "standalone", 4 * int(a.mem_gb * unit(a)) + (1 << 20)) if a.sim \
        else ("", {})
    rcs: list = []
    for job in ("job-a", "job-b"):
        try:
            rcs.append(subprocess.run(job_cmd(a, job, "standalone", ev, sim_dir=sim_dir), check=False, cwd=ROOT,
                                      env={**os.environ, **env}, timeout=a.job_timeout).returncode)
        except subprocess.TimeoutExpired:
            rcs.append("timeout")
    res = analyse(load(ev), "standalone (one job after the other)", sampler)
    res["job_exit_codes"] = rcs
    if any(rcs):
        res["violations"].append(f"job exit codes {rcs}")
    return res


def run_sliced(a, sampler, workdir: str, regime: str) -> dict:
    from timeslice.testing.agent import AgentProcess
    from timeslice.testing.etcd import EtcdCluster
    from timeslice.testing.lockd import LockdCluster
    logdir = os.path.join(workdir, regime)
    os.makedirs(logdir, exist_ok=True)
    if a.sim:      # the simulator holds the weights only; room for two jobs per GPU, or for one
        peak = int(a.mem_gb * unit(a))
        sim_dir, sim_env = sim_device(a, workdir, regime, (2 if regime == "fit" else 1) * peak + (64 << 10))
        margin, agent_kw = 0, {"backend": "sim", "sim_dir": sim_dir, "env": sim_env,
                               "extra": ["--sim-checkpoint-gbps", str(a.sim_gbps), "--sim-restore-gbps",
                                         str(a.sim_gbps)]}
    else:          # per rank: weights, activations, CUDA context + NCCL buffers
        peak = int((a.mem_gb + 2 * a.scratch_gb + 1.5) * GB)
        sim_dir, sim_env, margin, agent_kw = "", {}, 256 << 20, {"backend": a.backend}
    ballast: list[subprocess.Popen] = []
    with EtcdCluster(1, workdir=logdir) as etcd:
        lockd = LockdCluster(etcd.endpoints_str, "/timeslice/", n=1, logdir=logdir,
                             extra=["--device-margin-bytes", str(margin), "--swap-timeout", "120"]).start()
        agent = AgentProcess(etcd.endpoints_str, "/timeslice/", NODE, logdir, **agent_kw).start()
        try:
            from timeslice import OrchestratorClient
            admin = OrchestratorClient(target=",".join(lockd.targets), job_id="admin")
            admin.create_group(GROUP, nodes=[(NODE, list(range(a.gpus)))])
            if regime != "fit" and not a.sim:
                for g, free in enumerate(sampler.free()):    # room for one job's rank per GPU, plus 2 GB
                    nbytes = max(0, free - peak - 2 * GB)
                    p = subprocess.Popen([sys.executable, "-c", (
                        "import torch,time,sys; torch.cuda.set_device(int(sys.argv[2]));"
                        "x=torch.empty(int(sys.argv[1]),dtype=torch.uint8,device='cuda');"
                        "torch.cuda.synchronize(); print('ballast',flush=True); time.sleep(3600)"),
                        str(nbytes), str(g)], stdout=subprocess.PIPE, env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
                    p.stdout.readline()
                    ballast.append(p)
            ev = os.path.join(logdir, "jobs.jsonl")
            env = {**os.environ, "TIMESLICE_NODE_NAME": NODE, **sim_env}
            procs = []
            collective_a = regime == "collective-refused"
            if not collective_a:
                # Both jobs begin their loops together (their ranks up): on a loaded machine one job's
                # start could otherwise come after the other's few phases, and nothing would swap.
                env[ENV_BARRIER] = f"{os.path.join(logdir, 'barrier')}:2"
            for job in ("job-a", "job-b"):
                coll = int(collective_a and job == "job-a")
                cmd = job_cmd(a, job, "sliced", ev, ",".join(lockd.targets), collective=coll,
                              nccl_safe=0 if coll else 1, hint=peak * a.gpus, sim_dir=sim_dir)
                errf = open(os.path.join(logdir, f"{job}.stderr"), "wb")
                procs.append(subprocess.Popen(cmd, env=env, stdout=errf, stderr=subprocess.STDOUT, cwd=ROOT))
                if collective_a and job == "job-a":
                    time.sleep(a.gen_s / 2)                  # A holds first, so B's Acquire needs A moved
            rcs = wait_jobs(procs, a.job_timeout)
            events = load(ev)
            res = analyse(events, f"time-sliced, {regime}", sampler)
            res.update(swap_times(agent, events), job_exit_codes=rcs, hint_bytes_per_node=peak * a.gpus)
            if any(rcs):
                res["violations"].append(f"job exit codes {rcs}")
            if regime == "collective-refused":
                if not res["refused_snapshots"] or not all("collective" in r for r in res["refusal_reasons"]):
                    res["violations"].append("the agent did not refuse to checkpoint the collective job")
                if res.get("restored_phases"):
                    res["violations"].append("a collective job was restored: it must never have been checkpointed")
            return res
        finally:
            for p in ballast:
                p.kill()
            agent.stop()
            lockd.stop()


def table(doc: dict) -> str:
    rows = [f"{'run':40} {'wall s':>7} {'duty':>6} {'restored':>8} {'elided':>6} {'GB moved':>8} "
            f"{'refused':>7} {'AR ok':>5} {'viol':>4}"]
    for r in doc["results"]:
        if r["violations"]:                       # a job died or a rule broke: no figures, FAILED
            rows.append(f"{r['label']:40} FAILED ({'; '.join(r['violations'][:3])}); exit codes "
                        f"{r.get('job_exit_codes', '?')}")
            continue
        rows.append(f"{r['label']:40} {r.get('wall_s', 0):7.1f} {r.get('duty_cycle', 0):6.0%} "
                    f"{r.get('restored_phases', 0):8d} {r.get('elided', 0):6d} {r.get('bytes_moved', 0) / GB:8.1f} "
                    f"{r.get('refused_restores', 0):7d} {not any('all-reduce' in v for v in r['violations'])!s:>5} "
                    f"{len(r['violations']):4d}")
        for g, ops in (r.get("per_gpu_s") or {}).items():
            rows.append("    " + g + ": " + ", ".join(f"{op} {x['mean']:.2f}s mean / {x['max']:.2f}s max (n={x['n']})"
                                                       for op, x in ops.items()))
    rows.append(f"ideal sliced duty cycle {doc['ideal_duty_cycle']:.0%}; command: {doc['command']}")
    return "\n".join(rows)


def driver_main(a) -> int:
    out = a.out or os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="gpu-multi-")
    sampler = None if a.sim else GpuSampler(a.gpus)
    if sampler is not None:
        sampler.start()
    ideal = min(1.0, 2 * (a.gen_s + a.train_s) / (a.gen_s + a.reward_s + a.train_s))
    doc = {"command": "python -m benchmarks.gpu_multi " + " ".join(sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "params": vars(a), "ideal_duty_cycle": ideal,
           "nccl_checkpoint_safe_env": NCCL_SAFE, "results": []}

    def save() -> None:
        with open(os.path.join(out, "gpu_multi.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(out, "gpu_multi.txt"), "w") as f:
            f.write(table(doc) + "\n")

    if not a.no_standalone:
        doc["results"].append(run_standalone(a, sampler, workdir))
        save()
    for regime in [r for r in a.regimes.split(",") if r]:
        try:
            doc["results"].append(run_sliced(a, sampler, workdir, regime))
        except Exception as e:
            doc["results"].append({"label": f"time-sliced, {regime}", "violations": [f"run failed: {e!r}"]})
        print(json.dumps(doc["results"][-1]), flush=True)
        save()
    if sampler is not None:
        sampler.stop.set()
    print(table(doc))
    return 1 if any(r["violations"] for r in doc["results"]) else 0


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_multi",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--role", choices=["driver", "job", "rank"], default="driver", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else benchmarks/results)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of the node, one rank per GPU per job")
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma list of {', '.join(REGIMES)}")
    p.add_argument("--no-standalone", action="store_true", help="skip the one-job-at-a-time baseline")
    p.add_argument("--backend", default="cuda-driver", help="node agent backend (cuda-driver | cuda-cli)")
    p.add_argument("--sim", action="store_true",
                   help="dry run without GPU: SIMULATED GPUs, --mem-gb counts MiB, all-reduce over loopback TCP")
    p.add_argument("--sim-gbps", type=float, default=0.05, help="--sim: simulated copy bandwidth, GB/s")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--gen-s", type=float, default=1.5)
    p.add_argument("--reward-s", type=float, default=3.0)
    p.add_argument("--train-s", type=float, default=1.5)
    p.add_argument("--mem-gb", type=float, default=4.0, help="weights per rank, checksummed")
    p.add_argument("--scratch-gb", type=float, default=2.0, help="activations per rank and phase")
    p.add_argument("--release-cache", type=int, default=1, help="ranks empty the allocator cache after a phase")
    p.add_argument("--phase-timeout", type=float, default=120, help="a rank silent this long is hung, s")
    p.add_argument("--job-timeout", type=float, default=600)
    # job and rank roles (internal)
    for flag, kw in (("--job", {}), ("--mode", {}), ("--events", {}), ("--target", {"default": ""}),
                     ("--collective", {"type": int, "default": 0}), ("--nccl-safe", {"type": int, "default": 1}),
                     ("--hint-bytes", {"type": int, "default": 0}), ("--rank", {"type": int, "default": 0}),
                     ("--world", {"type": int, "default": 1}), ("--master-port", {"type": int, "default": 0}),
                     ("--seed", {"type": int, "default": 1}), ("--sim-dir", {"default": ""})):
        p.add_argument(flag, help=argparse.SUPPRESS, **kw)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.role in ("rank", "job"):
        from benchmarks import gpu_multi_job as J
        return (J.rank_main if a.role == "rank" else J.job_main)(a)
    return driver_main(a)


if __name__ == "__main__":
    raise SystemExit(main())
