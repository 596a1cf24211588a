"""Two RL jobs under a real Slurm (munged + slurmctld + slurmd on this machine) sharing one GPU.

The GPU is the SIMULATED device (etcd + one lockd + the node agent with the sim backend,
from the test harness); everything on the Slurm side is what deploy/slurm/ ships: the
task prolog hands the jobs lockd's target, the agent's socket, the node name and the
node's group, `timeslice slurm groups` creates that group from the partition's GPU layout,
the jobs are deploy/slurm/rl-pair.sbatch submitted with sbatch (one shard of the GPU each),
and their timeslice job ids are their SLURM_JOB_IDs. Checked: the jobs interleave on the
GPU and their GPU phases never overlap (their own records, tokens increasing); the agent
parks one to run the other; `scancel` of the parked job leaves nothing (no queue entry,
session or workers in etcd, no snapshot on the device) and the other job runs to the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurmharness import SlurmCluster, missing_binaries

from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.lockd.report.figures import overlapping_pairs
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdCluster

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
NODE, PARTITION = "tsnode0", "gpu"
MiB = 1 << 20
JOB_BYTES = 40 * MiB               # two of them never fit on the 64 MiB device: every handoff swaps

pytestmark = pytest.mark.slow


@pytest.fixture
def slurm_stack(etcd, key_prefix, tmp_path):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}); "
                    "`bash scripts/setup.sh` installs slurmctld, slurmd, slurm-client and munge from apt")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root (it starts each job as the job's user)")
    slurm = SlurmCluster(NODE, PARTITION, task_prolog=str(SLURM / "task-prolog.sh"))
    sim = tmp_path / "sim"
    SimDevice(sim, tmp_path / "host", capacity_bytes=64 * MiB)
    lockd = agent = None
    try:
        lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
        agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), sim_dir=sim,
                             state_dir=slurm.root / "agent",
                             env={"TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host")},
                             extra=["--require-attestation", "--sim-checkpoint-gbps", "0",
                                    "--sim-restore-gbps", "0"]).start()
        slurm.start()
        jobs_env = slurm.root / "jobs.env"            # what /etc/timeslice/jobs.env says on a cluster
        jobs_env.write_text(f"TIMESLICE_TARGET={lockd.replicas[0].target}\n"
                            f"TIMESLICE_AGENT_SOCKET={agent.socket}\nTIMESLICE_SLURM_GROUPS=node\n")
        bindir = str(Path(sys.executable).parent)
        slurm.env.update({
            "TIMESLICE_SLURM_JOBS_ENV": str(jobs_env), "TIMESLICE_BIN": os.path.join(bindir, "timeslice"),
            "TIMESLICE_SIM_DIR": str(sim), "TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host"),
            "PYTHON": sys.executable, "RL_JOB": str(ROOT / "examples" / "grpo" / "grpo_job.py"),
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        })
        for var in ("TIMESLICE_TARGET", "TIMESLICE_JOB_ID", "TIMESLICE_NODE_NAME", "TIMESLICE_GROUP"):
            slurm.env.pop(var, None)
        yield slurm, lockd, agent, sim
    except BaseException:
        print(slurm.log_tail())
        raise
    finally:
        slurm.stop()
        if agent is not None:
            agent.stop()
        if lockd is not None:
            lockd.stop()


def timeslice_cli(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "timeslice.cli", *args], capture_output=True, text=True,
                          env=slurm.env, timeout=60, check=False)


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def handoffs(phases: list[dict]) -> int:
    jobs = [p["job"] for p in sorted(phases, key=lambda p: p["t_start"])]
    return sum(1 for a, b in zip(jobs, jobs[1:]) if a != b)


def test_two_slurm_jobs_time_slice_one_gpu_and_scancel_of_the_parked_one_cleans_up(slurm_stack, etcd,
                                                                                    key_prefix):
    slurm, lockd, agent, sim = slurm_stack
    keys, target = Keys(key_prefix), lockd.replicas[0].target

    # The admin's step: groups from the partition's GPU layout (one GPU gres on the node).
    made = timeslice_cli(slurm, "slurm", "groups", "--partition", PARTITION, "--target", target, "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["groups"] == [{"group": NODE, "node": NODE, "gpus": [], "result": "created"}]

    # The researcher's step: the pair, one job per array task (two submissions, each its own arguments:
    # the survivor's GPU phases are long, so the other is parked while it computes).
    out = slurm.root / "out"
    events = out / "events.jsonl"
    survivor_args = f"--iterations 8 --phase-s 0.4 --bytes {JOB_BYTES} --events {events}"
    victim_args = f"--iterations 1000 --phase-s 0.1 --bytes {JOB_BYTES} --events {events}"
    [survivor] = slurm.sbatch(SLURM / "rl-pair.sbatch", "--array=0", f"--output={out}/%A_%a.out",
                              env={"RL_ARGS": survivor_args}, cwd=out)
    [victim] = slurm.sbatch(SLURM / "rl-pair.sbatch", "--array=1", f"--output={out}/%A_%a.out",
                            env={"RL_ARGS": victim_args}, cwd=out)
    # An array job's first task is the array job itself: its SLURM_JOB_ID is the id sbatch printed.
    both = {survivor, victim}

    def running_jobs() -> set[str]:
        return {j for j, f in slurm.jobs().items() if f.get("JobState") == "RUNNING"}
    slurm.wait_for(lambda: both <= running_jobs(), 30, "both jobs running on the node, side by side")

    # They interleave: the agent swaps one out for the other at every handoff.
    slurm.wait_for(lambda: handoffs(read_events(events)) >= 3, 60, "three handoffs between the jobs")
    phases = read_events(events)
    assert {p["job"] for p in phases} == both, "the timeslice job ids are the Slurm job ids"
    assert any(p["restored"] and p["bytes_moved"] > 0 for p in phases), "a handoff that swapped"

    from timeslice import OrchestratorClient
    with OrchestratorClient(target, job_id="slurm-test-admin") as admin:
        def victim_parked() -> bool:
            st = admin.status(NODE)
            states = {j.job_id: j.state for n in st.node_status for j in n.jobs}
            return bool(st.grant and st.grant.job_id == survivor and states.get(victim) == "snapshotted"
                        and any(w.job_id == victim for w in st.waiters))
        slurm.wait_for(victim_parked, 60, "the victim parked (snapshotted, waiting) while the survivor holds")
        victim_pids = [int(k.rsplit("/", 1)[-1]) for k in etcd.etcdctl(
            "get", "--prefix", "--keys-only", keys.workers(victim).decode()).split()]
        assert victim_pids, "the victim registered its worker"

        slurm.scancel(victim)

        # Nothing of the victim is left: its place in the queue, session and workers in etcd. The
        # `closed` marker (a lease of its own, 60 s) says it closed its session itself, on SIGTERM:
        # agents then freeze nothing of it, and nobody waited for its lease to run out.
        def victim_gone_from_etcd() -> bool:
            left = etcd.etcdctl("get", "--prefix", "--keys-only", keys.job(victim).decode()).split()
            queued = etcd.etcdctl("get", "--keys-only", keys.queue_entry(NODE, victim).decode()).split()
            return left == [keys.closed(victim).decode()] and not queued
        slurm.wait_for(victim_gone_from_etcd, 30, "the cancelled job's queue entry, session and workers gone")
        slurm.wait_for(lambda: slurm.state(victim) == "CANCELLED", 30, "Slurm says CANCELLED")
        # ... its status on the node and its parked bytes on the device.
        dev = SimDevice(sim)

        def victim_gone_from_node() -> bool:
            st = admin.status(NODE)
            states = {j.job_id: j.state for n in st.node_status for j in n.jobs}
            held = dev.ledger.snapshot()[1]
            return states.get(victim) in (None, "gone") and not any(p in held for p in victim_pids)
        slurm.wait_for(victim_gone_from_node, 30, "the cancelled job's status and device bytes gone")
        assert victim not in {j.job_id for j in admin.jobs()}

    # The survivor runs to its end, alone.
    slurm.wait_for(lambda: slurm.state(survivor) == "COMPLETED", 60, "the survivor completed")
    report = [json.loads(line) for line in (out / f"{survivor}_0.out").read_text().splitlines()
              if line.startswith("{")]
    assert report and report[-1]["digest_ok"] and report[-1]["iterations"] == 8, report

    # Every GPU phase of both jobs, from their own records: never two at once, tokens increasing.
    phases = sorted(read_events(events), key=lambda p: p["t_start"])
    assert overlapping_pairs(phases) == []
    tokens = [p["token"] for p in phases]
    assert all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    assert sum(1 for p in phases if p["job"] == survivor) == 16     # 8 iterations x (generate, train)
