"""Real node agents and simulated-GPU workers as processes, for tests, chaos scenarios and demos.

``AgentProcess`` is the launcher's ``NodeAgent`` (``python -m timeslice.nodeagent.cli
serve`` on a free loopback port, logging JSON to its own file) with the
harness's faults: stopped (SIGTERM: finishes the op in flight), killed
(SIGKILL), paused and resumed, and restarted on the same node name and state
dir. ``SimWorker`` is a worker process on the SIMULATED device
(``python -m timeslice.sim.worker``) driven line by line: it holds real bytes
whose checksum it can verify after a snapshot and restore.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

from timeslice.launcher.servers import Launch, NodeAgent, SimFlags
from timeslice.testing.lockd import shared_admin_token
from timeslice.testing.procs import track, untrack
from timeslice.testing.server import ServerProcess


class AgentProcess(ServerProcess, NodeAgent):
    """A node agent on a free loopback port, metrics off; its state dir and channel socket are the test's."""

    NAME = "nodeagent"

    def __init__(self, etcd_endpoints: str, prefix: str, node: str, logdir: str, backend: str = "sim",
                 sim_dir: str | os.PathLike | None = None, extra: list[str] | None = None,
                 state_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None):
        state_dir = str(state_dir or os.path.join(logdir, f"agent-{node}-state"))
        shared_admin_token()
        # The cooperative channel's socket lives with the test's files: agents of tests that run
        # at once (same node names) must never share one.
        self._socket = os.path.join(state_dir, "agent.sock")
        super().__init__(node, etcd_endpoints, prefix, os.path.join(logdir, f"nodeagent-{node}.log"),
                         Launch(extra=extra or [], env=dict(env or {})), state_dir=state_dir, backend=backend,
                         sim=SimFlags(str(sim_dir) if sim_dir else None), channel_socket=self._socket)

    @property
    def socket(self) -> str:
        """The cooperative channel's socket path (always set here; the launcher's may be None)."""
        return self._socket

    def stop(self, grace: float = 15.0) -> None:
        super().stop(grace)


class SimWorker:
    """A simulated-GPU worker process (SIMULATOR): ``READY``, then one command per line.

    Commands: ``verify`` (device checksum against the fill: blocks while
    snapshotted), ``checksum``, ``hold <ms>``, ``steps``, ``quit``.
    """

    def __init__(self, sim_dir: str | os.PathLike, nbytes: int, seed: int = 1, step_ms: float = 1.0,
                 env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timeslice.sim.worker", "--sim-dir", str(sim_dir), "--bytes", str(nbytes),
             "--seed", str(seed), "--step-ms", str(step_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True, env={**os.environ, **(env or {})})
        track(self.proc)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr   # all three are pipes
        self._stdin, self._stdout, self._stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        self.pid, self.nbytes, self.expected = self.proc.pid, nbytes, ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self._stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def read(self, timeout: float = 10.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.pid} said nothing in {timeout}s") from None
        if line is None:
            raise EOFError(f"worker {self.pid} exited rc={self.proc.wait()}: {self._stderr.read()}")
        return line

    def ready(self, timeout: float = 15.0) -> SimWorker:
        tag, pid, sha = self.read(timeout).split()
        assert tag == "READY" and int(pid) == self.pid, (tag, pid)
        self.expected = sha
        return self

    def ask(self, cmd: str, timeout: float = 10.0) -> str:
        self._stdin.write(cmd + "\n")
        self._stdin.flush()
        return self.read(timeout)

    def verify(self, timeout: float = 10.0) -> bool:
        """True if the device bytes still hash to what the worker wrote (blocks while snapshotted)."""
        return self.ask("verify", timeout) == f"VERIFY OK {self.expected}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        untrack(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit", timeout=2)
                self.proc.wait(2)
            except (OSError, EOFError, TimeoutError, subprocess.TimeoutExpired):
                pass
        self.kill()
