"""Real lockd replicas as processes, for tests, chaos scenarios and benchmarks.

Each replica is ``python -m lockd.cli serve`` on a free loopback port (it
prints ``LOCKD_READY port=N``), logging JSON to its own file. Replicas can be
stopped (SIGTERM: graceful, resigns), killed (SIGKILL), paused and resumed.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from tscore.testing.procs import pid_alive, signal_tree, terminate, track, untrack


class LockdProcess:
    def __init__(self, endpoints: str, prefix: str, replica_id: str, logdir: str, extra: list[str]):
        self.endpoints, self.prefix, self.replica_id = endpoints, prefix, replica_id
        self.log_path = os.path.join(logdir, f"lockd-{replica_id}.log")
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log_start = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "LockdProcess":
        argv = [sys.executable, "-m", "lockd.cli", "serve", "--etcd-endpoints", self.endpoints,
                "--prefix", self.prefix, "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                "--replica-id", self.replica_id, *self.extra]
        try:
            self._log_start = os.path.getsize(self.log_path)   # a restart appends: read only its lines
        except FileNotFoundError:
            self._log_start = 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        track(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lockd {self.replica_id} exited rc={self.proc.returncode}:\n{self.log_tail()}")
            port = self._ready_port()
            if port:
                self.port = port
                return self
            time.sleep(0.05)
        raise TimeoutError(f"lockd {self.replica_id} not ready in {timeout}s:\n{self.log_tail()}")

    def _ready_port(self) -> int:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                for line in f:
                    if line.startswith(b"LOCKD_READY "):
                        fields = dict(kv.split(b"=", 1) for kv in line.split()[1:])
                        return int(fields[b"port"])
        except FileNotFoundError:
            pass
        return 0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            terminate([self.proc], grace)
            untrack(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None:
            signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            untrack(self.proc.pid)

    def pause(self) -> None:
        signal_tree(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        signal_tree(self.pid, signal.SIGCONT)

    def restart(self, timeout: float = 30.0) -> "LockdProcess":
        if self.alive():
            self.stop()
        return self.start(timeout)

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self, name: str) -> list[dict]:
        """Structured log events named ``name`` (stable keys: group, job, token, epoch, ...)."""
        out = []
        with open(self.log_path, "rb") as f:
            for line in f:
                if line.startswith(b"{"):
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if ev.get("event") == name:
                        out.append(ev)
        return out


class LockdCluster:
    """``n`` replicas against one etcd (cluster) and one key prefix."""

    def __init__(self, etcd_endpoints: str, prefix: str, n: int = 3, logdir: str | None = None,
                 extra: list[str] | None = None):
        self.logdir = logdir or tempfile.mkdtemp(prefix="lockd-")
        self.etcd_endpoints, self.prefix = etcd_endpoints, prefix
        self.replicas = [LockdProcess(etcd_endpoints, prefix, f"r{i}", self.logdir, extra or [])
                         for i in range(n)]

    def start(self) -> "LockdCluster":
        for r in self.replicas:
            r.start()
        return self

    def stop(self) -> None:
        for r in self.replicas:
            r.resume() if r.alive() else None
        terminate([r.proc for r in self.replicas if r.proc is not None], 10.0)

    def __enter__(self) -> "LockdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self.replicas if r.alive()]

    def by_id(self, replica_id: str) -> LockdProcess:
        return next(r for r in self.replicas if r.replica_id == replica_id)

    def leader(self, etcd, timeout: float = 15.0) -> tuple[LockdProcess, int]:
        """(leading replica, epoch), read from the election keys in etcd."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = etcd.etcdctl("get", self.prefix + "leader/", "--prefix", "-w", "json")
            kvs = json.loads(out).get("kvs", [])
            if kvs:

                head = min(kvs, key=lambda kv: int(kv["create_revision"]))
                rid = json.loads(base64.b64decode(head["value"]))["replica"]
                rep = self.by_id(rid)
                if rep.alive():
                    return rep, int(head["create_revision"])
            time.sleep(0.1)
        raise TimeoutError("no lockd leader elected")

    def dump_logs(self, n: int = 40) -> str:
        return "\n".join(f"--- {r.replica_id} ---\n{r.log_tail(n)}" for r in self.replicas)


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False
