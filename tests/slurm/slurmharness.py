"""A real Slurm on this machine, for tests: munged + slurmctld + slurmd of the test's own.

Everything lives in one short temp dir (a Unix socket path must fit in 108 bytes): a
fresh munge key and socket, a generated ``slurm.conf``/``gres.conf``, the state and spool
dirs, the logs. One node (``NodeName`` chosen by the test, ``slurmd -N``) on the loopback
address with this machine's CPUs, a GPU as a gres whose device file is a character device
made here (Slurm wants one; nothing reads it: the "GPU" the jobs use is the SIMULATED
device), and shards of it, so two jobs can share it as on a real cluster. Ports are free
unprivileged ones. Client commands get ``SLURM_CONF`` from ``env``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from timeslice.testing.ports import free_port
from timeslice.testing.procs import terminate, track

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(self, node: str = "tsnode0", partition: str = "gpu", shards: int = 4,
                 task_prolog: str | None = None, kill_wait_s: int = 5):
        self.root = Path(tempfile.mkdtemp(prefix="tsslurm-", dir="/tmp"))
        self.node, self.partition, self.shards = node, partition, shards
        self.task_prolog, self.kill_wait_s = task_prolog, kill_wait_s
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> SlurmCluster:
        for d in ("munge", "ctld", "spool", "log", "dev", "out"):
            (self.root / d).mkdir(mode=0o755)
        os.chmod(self.root, 0o755)               # munged wants its socket's dirs reachable by all
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self.wait_for(lambda: self.node_state() == "idle", timeout, "the node idle in sinfo")
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self.root / "munge" / "munge.sock"
        self._spawn("munged", ["munged", "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                               f"--log-file={self.logs / 'munged.log'}"])
        self.wait_for(sock.exists, 10, "munged's socket")
        self.munge_socket = sock

    def _gpu_device(self) -> Path:
        dev = self.root / "dev" / "simgpu0"
        try:                                     # a character device (the same numbers as /dev/null)
            os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:                  # no CAP_MKNOD: Slurm logs a complaint and goes on
            dev.touch()
        return dev

    def _write_conf(self) -> None:
        r = self.root
        dev = self._gpu_device()
        lines = [
            "ClusterName=tstest",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "CredType=cred/munge",
            f"StateSaveLocation={r / 'ctld'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'ctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}", f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "ReturnToService=2", "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"KillWait={self.kill_wait_s}", "MinJobAge=600", "InactiveLimit=0",
            "SlurmctldTimeout=30", "SlurmdTimeout=30",
            "GresTypes=gpu,shard",
            *([f"TaskProlog={self.task_prolog}"] if self.task_prolog else []),
            f"NodeName={self.node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"CPUs={os.cpu_count() or 1} RealMemory=1000 Gres=gpu:1,shard:{self.shards} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File={dev}\n"
            f"NodeName={self.node} Name=shard Count={self.shards} File={dev}\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.logs / f"{name}.out", "wb")  # noqa: SIM115 - the child's, closed by the OS
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        out.close()
        track(p)
        self.procs[name] = p

    # -- commands -------------------------------------------------------------------------
    def run(self, *argv: str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 30.0) -> str:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                           env={**self.env, **(env or {})}, check=False)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: rc={r.returncode} {r.stderr.strip()[-2000:]}")
        return r.stdout

    def sbatch(self, script: str | os.PathLike, *args: str, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> list[str]:
        """Submit; the job ids (an array gives one per task once they are known, via squeue)."""
        argv = ["sbatch", "--parsable", *args, str(script)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**self.env, **(env or {})},
                           cwd=cwd, check=False)
        if r.returncode != 0:
            raise SlurmError(f"sbatch: rc={r.returncode} {r.stderr.strip()[-2000:]}")
        return [r.stdout.strip().split(";")[0]]

    def node_state(self) -> str:
        return self.run("sinfo", "--noheader", "--Node", "--format=%t", check=False).strip()

    def jobs(self) -> dict[str, dict[str, str]]:
        """Every job slurmctld still knows (running, pending, or ended within MinJobAge): id -> fields."""
        out = self.run("scontrol", "--oneliner", "show", "job", check=False)
        jobs = {}
        for line in out.splitlines():
            fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
            if "JobId" in fields:
                jobs[fields["JobId"]] = fields
        return jobs

    def state(self, job_id: str) -> str:
        return self.jobs().get(job_id, {}).get("JobState", "")

    def scancel(self, job_id: str) -> None:
        self.run("scancel", job_id)

    @staticmethod
    def wait_for(pred, timeout: float, what: str, every: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(every)
        raise AssertionError(f"never happened within {timeout}s: {what}")

    def log_tail(self, n: int = 30) -> str:
        out = []
        for p in sorted(self.logs.glob("*")):
            lines = p.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {p.name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel what runs, wait for it to end (bounded), then the daemons; the temp dir goes."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition", self.partition, check=False)
            try:
                self.wait_for(lambda: not any(j.get("JobState") in ("RUNNING", "PENDING", "COMPLETING")
                                              for j in self.jobs().values()),
                              self.kill_wait_s + 15, "every job ended")
            except AssertionError:
                pass
        self._kill_job_leftovers()
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is not None:
                terminate([p], 5.0)
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_job_leftovers(self) -> None:
        # slurmstepd and the jobs it runs are not slurmd's process group: find ours by the
        # SLURM_CONF in their environment (this cluster's own temp path) and end them.
        mark = f"SLURM_CONF={self.conf}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            if mark in env.split(b"\0"):
                try:
                    os.kill(int(d.name), signal.SIGKILL)
                except OSError:
                    pass
