"""The seed's loop (generate → rewards on CPU → train), as written, for two jobs
in two processes sharing sampler-group and trainer-group: the critical sections
never overlap per group and the fencing tokens only grow."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from timeslice import OrchestratorClient

SEED_JOB = Path(__file__).with_name("seed_job.py")


def test_seed_loop_two_jobs_interleave_without_overlap(lockd, tmp_path, proc_reaper, clients):
    admin = clients(OrchestratorClient(lockd.targets, job_id="seed-admin"))
    for g in ("sampler-group", "trainer-group"):
        admin.create_group(g, ["node-a:0"])
    log = tmp_path / "sections.jsonl"
    target = ",".join(lockd.targets)
    procs = []
    for job, spelling in (("rl-job-1", "ts"), ("rl-job-2", "oc")):
        env = {**os.environ, "TIMESLICE_TARGET": target, "TIMESLICE_JOB_ID": job, "SEED_LOG": str(log),
               "SEED_ITERATIONS": "4"}
        p = subprocess.Popen([sys.executable, str(SEED_JOB), spelling], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        proc_reaper.register(p)
        procs.append(p)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "SEED_DONE" in out

    sections = [json.loads(line) for line in log.read_text().splitlines()]
    by_group = defaultdict(list)
    for s in sections:
        by_group[s["group"]].append(s)
    assert set(by_group) == {"sampler-group", "trainer-group"}
    for group, ss in by_group.items():
        assert len(ss) == 8, ss                                  # 2 jobs x 4 iterations
        assert {s["job"] for s in ss} == {"rl-job-1", "rl-job-2"}
        ss.sort(key=lambda s: s["start"])
        for a, b in zip(ss, ss[1:]):
            assert b["start"] >= a["end"], f"overlap on {group}: {a} / {b}"
            assert b["token"] > a["token"], f"token not increasing on {group}: {a} / {b}"
