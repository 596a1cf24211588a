"""Run two GRPO-style jobs (grpo_job.py) at once on one local cluster's simulated GPU.

    timeslice up --detach --backend sim      # once
    python examples/grpo/run_pair.py         # two jobs, time-sliced; prints what each lockd grant did

Both jobs' policies (40 MiB each by default) do not fit the local cluster's
64 MiB simulated device together, so a handoff snapshots one job to host
memory and restores the other; each job checks every byte of its policy at
every step.
The target, node and simulated device come from the running local cluster
(``timeslice up``), or from --target/--node/--sim-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def local_cluster() -> dict:
    from timeslice.launcher.settings import load
    from timeslice.launcher.state import find_running_anywhere
    found = find_running_anywhere(load()[0].log_dir)
    return found[1] if found else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="lockd (default: the running local cluster)")
    ap.add_argument("--node", default=None, help="the agent's node (default: the local cluster's)")
    ap.add_argument("--sim-dir", default=None, help="the simulated device (default: the local cluster's)")
    ap.add_argument("--group", default="rl-gpus", help="default: %(default)s")
    ap.add_argument("--iterations", type=int, default=3, help="default: %(default)s")
    ap.add_argument("--phase-s", type=float, default=0.1, help="default: %(default)s")
    ap.add_argument("--bytes", type=int, default=40 << 20, help="each job's policy size (default: %(default)s)")
    a = ap.parse_args()
    doc = local_cluster() if not (a.target and a.node and a.sim_dir) else {}
    target, node = a.target or doc.get("target"), a.node or doc.get("node")
    sim_dir = a.sim_dir or (doc.get("sim") or {}).get("dir")
    if not (target and node and sim_dir):
        print("run_pair: no local cluster with a simulated device found; start one with "
              "`timeslice up --detach --backend sim`, or pass --target, --node and --sim-dir", file=sys.stderr)
        return 2
    from timeslice import AlreadyExistsError, OrchestratorClient
    with OrchestratorClient(target, job_id="grpo-example-admin") as admin:
        try:
            admin.create_group(a.group, nodes=[node])
        except AlreadyExistsError:
            pass
    jobs = []
    for job in ("grpo-a", "grpo-b"):
        env = {**os.environ, "TIMESLICE_TARGET": target, "TIMESLICE_JOB_ID": job, "TIMESLICE_NODE_NAME": node,
               "TIMESLICE_SIM_DIR": sim_dir}
        jobs.append(subprocess.Popen(
            [sys.executable, str(HERE / "grpo_job.py"), "--group", a.group, "--iterations", str(a.iterations),
             "--phase-s", str(a.phase_s), "--bytes", str(a.bytes)],
            env=env, stdout=subprocess.PIPE, text=True))
    results, rc = [], 0
    for p in jobs:
        out, _ = p.communicate(timeout=600)
        rc = rc or p.returncode
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"returncode": p.returncode})
    print(json.dumps({"jobs": results, "ok": rc == 0}, sort_keys=True), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
