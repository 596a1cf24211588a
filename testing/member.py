"""One etcd member for tests (``HarnessMember``): the launcher's ``EtcdMember`` plus kill, pause, resume and restart.

A member keeps its name, ports and data dir for its whole life, so a restart
comes back as the same raft member and rejoins its cluster with its old data.
Every launch is tracked (killed at interpreter exit), and a member that exits
although nobody stopped it is reported with its log.
"""
from __future__ import annotations

import os
import signal

from timeslice.launcher import etcd as launcher
from timeslice.testing import procs
from timeslice.testing.ctl import (
    ETCD_BIN_ENV,
    EtcdHarnessError,
    PortCollision,
    find_binary,
)


class HarnessMember(launcher.EtcdMember):
    """An etcd server on 127.0.0.1; its log (all runs appended) is ``log_path``."""

    def __init__(self, name: str, client_port: int, peer_port: int, workdir: str, cluster_args: list[str]):
        super().__init__(name, client_port, peer_port, os.path.join(workdir, f"{name}.etcd"),
                         os.path.join(workdir, f"{name}.log"), cluster_args,
                         binary=find_binary("etcd", ETCD_BIN_ENV))
        self._down_on_purpose = False  # stop()/kill() was called: not a crash
        self.paused = False

    def is_running(self) -> bool:
        """True while the process exists, paused or not."""
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ---------------------------------------------------------

    def launch(self, state: str = "new") -> HarnessMember:
        """Start the process; ``state`` is etcd's --initial-cluster-state (new|existing)."""
        if self.is_running():
            raise EtcdHarnessError(f"etcd {self.name} is already running")
        super().launch(state)
        assert self.proc is not None     # launch spawned it
        procs.track(self.proc)
        self._down_on_purpose = False
        self.paused = False
        return self

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
        if self.proc is not None:
            procs.terminate(self.proc, grace)

    def kill(self) -> None:
        """SIGKILL: a crash, no chance to flush or say goodbye; reaps it."""
        self._down_on_purpose = True
        self.paused = False
        if self.proc is None:
            return
        super().kill()
        procs.untrack(self.proc.pid)

    def pause(self) -> None:
        """SIGSTOP: alive but silent, as in a long GC pause or a frozen VM."""
        self._signal(signal.SIGSTOP)
        if self.proc is not None:
            procs.wait_stopped(self.proc.pid)   # returns once it is really silent (testing/procs.py)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def _signal(self, sig: int) -> None:
        if not self.is_running():
            raise EtcdHarnessError(f"etcd {self.name} is not running")
        self.signal(sig)

    # -- probes ------------------------------------------------------------

    def check_not_crashed(self) -> None:
        """Raise if the process exited although nobody stopped it (with its log)."""
        if self.proc is None or self._down_on_purpose or self.proc.poll() is None:
            return
        tail = self.log_tail(60)
        error = PortCollision if "address already in use" in tail else EtcdHarnessError
        raise error(f"etcd {self.name} exited with {self.proc.returncode}\n{tail}")

    def __repr__(self) -> str:
        return f"HarnessMember({self.name}, {self.endpoint}, pid={self.pid})"
