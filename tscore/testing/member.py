"""One etcd server process: start, stop, kill, pause, resume, restart, probe.

A member keeps its name, ports and data dir for its whole life, so a restart
comes back as the same raft member and rejoins its cluster with its old data.
"""
from __future__ import annotations

import os
import signal
import subprocess

from timeslice.testing import procs
from timeslice.testing.ctl import (ETCD_BIN_ENV, EtcdHarnessError, PortCollision, clean_env,
                                find_binary, http_json)


class EtcdMember:
    """An etcd server on 127.0.0.1; its log (all runs appended) is ``log_path``."""

    def __init__(self, name: str, client_port: int, peer_port: int, workdir: str,
                 cluster_args: list[str]):
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = os.path.join(workdir, f"{name}.etcd")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self._cluster_args = cluster_args
        self._proc: subprocess.Popen | None = None
        self._down_on_purpose = False  # stop()/kill() was called: not a crash
        self.paused = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        """True while the process exists, paused or not."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ---------------------------------------------------------

    def launch(self, state: str) -> None:
        """Start the process; ``state`` is etcd's --initial-cluster-state (new|existing)."""
        if self.is_running():
            raise EtcdHarnessError(f"etcd {self.name} is already running")
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        argv = [find_binary("etcd", ETCD_BIN_ENV), "--name", self.name,
                "--data-dir", self.data_dir,
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster-state", state, *self._cluster_args]
        with open(self.log_path, "ab") as log:
            log.write(f"----- launch {state}: {' '.join(argv)}\n".encode())
            log.flush()
            # Own session: signals reach only etcd, and the pid leads its own group.
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=clean_env(),
                                          start_new_session=True)
        procs.track(self._proc)
        self._down_on_purpose = False
        self.paused = False

    def restart(self) -> None:
        """Start again on the same data dir and ports, rejoining the existing cluster.

        Returns once the process runs; call the cluster's ``wait_healthy`` to wait
        until it serves.
        """
        self.launch("existing")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (resuming it if paused), SIGKILL after ``grace`` seconds; reaps it."""
        self._down_on_purpose = True
        self.paused = False
        if self._proc is not None:
            procs.terminate(self._proc, grace)

    def kill(self) -> None:
        """SIGKILL: a crash, no chance to flush or say goodbye; reaps it."""
        self._down_on_purpose = True
        self.paused = False
        if self._proc is None:
            return
        if self._proc.poll() is None:
            procs.signal_tree(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        procs.untrack(self._proc.pid)

    def pause(self) -> None:
        """SIGSTOP: alive but silent, as in a long GC pause or a frozen VM."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def _signal(self, sig: int) -> None:
        if not self.is_running():
            raise EtcdHarnessError(f"etcd {self.name} is not running")
        procs.signal_tree(self._proc.pid, sig)

    # -- probes ------------------------------------------------------------

    def check_not_crashed(self) -> None:
        """Raise if the process exited although nobody stopped it (with its log)."""
        if self._proc is None or self._down_on_purpose or self._proc.poll() is None:
            return
        tail = self.log_tail(60)
        error = PortCollision if "address already in use" in tail else EtcdHarnessError
        raise error(f"etcd {self.name} exited with {self._proc.returncode}\n{tail}")

    def healthy(self, timeout: float = 1.0) -> bool:
        """True if the member answers /health with health=true (it has a leader, no alarm)."""
        reply = http_json(self.client_port, "/health", None, timeout)
        return bool(reply) and reply.get("health") in ("true", True)

    def status(self, timeout: float = 1.0) -> dict | None:
        """The Maintenance.Status reply as JSON (ids are decimal strings), or None."""
        return http_json(self.client_port, "/v3/maintenance/status", b"{}", timeout)

    def log_tail(self, max_lines: int = 200) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-max_lines:])

    def __repr__(self) -> str:
        return f"EtcdMember({self.name}, {self.endpoint}, pid={self.pid})"
