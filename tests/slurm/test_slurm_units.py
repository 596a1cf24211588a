"""The Slurm glue without a Slurm: sinfo's GPU layout to groups, a task's environment, deploy/slurm's files."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from timeslice import slurm as S
from timeslice.common.errors import InvalidIdError
from timeslice.model import NodeSpec

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"

SINFO = """\
gpu01|gpu:h200:8(S:0-1),shard:h200:64(S:0-1)|timeslice,ib
gpu02|gpu:h200:4(S:0,1)|(null)
cpu01|(null)|(null)
gpu01|gpu:h200:8(S:0-1),shard:h200:64(S:0-1)|timeslice,ib
tiny|gpu:1,shard:4|timeslice
"""


def test_gpu_counts_from_gres_strings():
    assert S.gpu_count("gpu:h200:8(S:0-1),shard:h200:64(S:0-1)") == 8
    assert S.gpu_count("gpu:a100:2(S:0),gpu:t4:1(S:1)") == 3      # two types on one node
    assert S.gpu_count("gpu:4(S:0,1)") == 4                        # a comma inside the socket binding
    assert S.gpu_count("gpu") == 1 and S.gpu_count("gpu:h200") == 1
    assert S.gpu_count("(null)") == 0 and S.gpu_count("") == 0 and S.gpu_count("shard:8,mps:100") == 0


def test_groups_from_a_partitions_layout():
    nodes = S.parse_sinfo(SINFO)
    assert [n.name for n in nodes] == ["gpu01", "gpu02", "cpu01", "tiny"]      # a node once, first seen
    assert S.plan_groups(nodes) == [("gpu01", NodeSpec("gpu01")), ("gpu02", NodeSpec("gpu02")),
                                    ("tiny", NodeSpec("tiny"))]
    per_gpu = S.plan_groups(nodes, S.PER_GPU, prefix="slurm-", feature="timeslice")
    assert per_gpu[0] == ("slurm-gpu01-gpu0", NodeSpec("gpu01", (0,)))
    assert [g for g, _ in per_gpu][-2:] == ["slurm-gpu01-gpu7", "slurm-tiny-gpu0"] and len(per_gpu) == 9
    with pytest.raises(S.SlurmError):
        S.plan_groups(nodes, "rack")
    with pytest.raises(S.SlurmError, match="line 1"):
        S.parse_sinfo("gpu01 gpu:8\n")
    with pytest.raises(InvalidIdError):
        S.plan_groups([S.SlurmNode("bad/name", 1)])


def test_task_env_site_values_node_from_slurm_and_the_jobs_own_group():
    site = {"TIMESLICE_TARGET": "ctl-0:50051,ctl-1:50051", "TIMESLICE_AGENT_SOCKET": "/run/timeslice/agent.sock"}
    task = {"SLURMD_NODENAME": "gpu01", "SLURM_JOB_ID": "77", "TIMESLICE_TARGET": "login-node-leftover:1",
            "TIMESLICE_NODE_NAME": "login01"}
    env, warnings = S.task_env(task, site)
    assert env == {**site, "TIMESLICE_NODE_NAME": "gpu01", "TIMESLICE_GROUP": "gpu01"} and not warnings
    # The job's own group (a job option) wins; the site's target and the node's name always do.
    env, _ = S.task_env({**task, "TIMESLICE_GROUP": "my-pair"}, site)
    assert env["TIMESLICE_GROUP"] == "my-pair" and env["TIMESLICE_TARGET"] == site["TIMESLICE_TARGET"]
    # Per GPU: the one GPU Slurm gave the job, else no group and a warning that says what to do.
    per_gpu = {**site, S.KEY_SCHEME: "gpu", S.KEY_PREFIX: "s-"}
    assert S.task_env({**task, "SLURM_JOB_GPUS": "3"}, per_gpu)[0]["TIMESLICE_GROUP"] == "s-gpu01-gpu3"
    assert S.task_env({**task, "CUDA_VISIBLE_DEVICES": "5"}, per_gpu)[0]["TIMESLICE_GROUP"] == "s-gpu01-gpu5"
    env, warnings = S.task_env({**task, "SLURM_JOB_GPUS": "0,1"}, per_gpu)
    assert "TIMESLICE_GROUP" not in env and "TIMESLICE_GROUP yourself" in warnings[0]
    env, warnings = S.task_env({}, site)
    assert env == site and "SLURMD_NODENAME" in warnings[0]
    with pytest.raises(InvalidIdError):
        S.task_env({**task, "TIMESLICE_GROUP": "no spaces"}, site)
    with pytest.raises(S.SlurmError):
        S.task_env(task, {S.KEY_SCHEME: "rack"})


def test_settings_file_and_export_lines():
    text = (SLURM / "etc" / "jobs.env").read_text()
    got = S.read_settings(text)
    assert set(got) == {"TIMESLICE_TARGET", "TIMESLICE_AGENT_SOCKET", S.KEY_SCHEME, S.KEY_PREFIX}
    assert got[S.KEY_SCHEME] in S.SCHEMES
    assert S.read_settings("export A='x y' # note\nB=\"2\"\n# c\n") == {"A": "x y", "B": "2"}
    with pytest.raises(S.SlurmError, match="jobs.env:1"):
        S.read_settings("not a setting", "jobs.env")
    with pytest.raises(S.SlurmError):
        S.read_settings("A=1\n" * 20000)
    assert S.export_lines({"B": "2", "A": "x y"}) == ["export A=x y", "export B=2"]
    with pytest.raises(S.SlurmError):
        S.export_lines({"A": "two\nlines"})


def test_task_prolog_prints_exports_and_never_fails_the_task(tmp_path):
    site = tmp_path / "jobs.env"
    site.write_text("TIMESLICE_TARGET=ctl-0:50051\nTIMESLICE_AGENT_SOCKET=/run/timeslice/agent.sock\n")
    bindir = Path(sys.executable).parent
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "SLURMD_NODENAME": "gpu01",
           "TIMESLICE_SLURM_JOBS_ENV": str(site), "TIMESLICE_BIN": str(bindir / "timeslice")}
    out = subprocess.run(["sh", str(SLURM / "task-prolog.sh")], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out == ["export TIMESLICE_AGENT_SOCKET=/run/timeslice/agent.sock", "export TIMESLICE_GROUP=gpu01",
                   "export TIMESLICE_NODE_NAME=gpu01", "export TIMESLICE_TARGET=ctl-0:50051"]
    site.write_text("garbage\n")
    bad = subprocess.run(["sh", str(SLURM / "task-prolog.sh")], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 0 and not any(ln.startswith("export") for ln in bad.stdout.splitlines())
    assert any(ln.startswith("print ") and "expected KEY=VALUE" in ln for ln in bad.stdout.splitlines())


def test_deploy_slurm_scripts_parse():
    for script in ("task-prolog.sh", "rl-pair.sbatch"):
        subprocess.run(["bash", "-n", str(SLURM / script)], check=True, timeout=30)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", sorted(p.name for p in (SLURM / "systemd").glob("*.service")))
def test_systemd_units_verify(unit):
    r = subprocess.run(["systemd-analyze", "verify", str(SLURM / "systemd" / unit)], capture_output=True,
                       text=True, timeout=60, check=False)
    # The units name the install's paths (/opt/timeslice/bin, /usr/bin/etcd), which CI does not have.
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if ln.strip() and "is not executable: No such file or directory" not in ln]
    assert not problems, problems
