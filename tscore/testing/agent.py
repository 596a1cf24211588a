"""Real node agents and simulated-GPU workers as processes, for tests, chaos scenarios and demos.

``AgentProcess`` runs ``python -m nodeagent.cli serve`` on a free loopback port
(it prints ``NODEAGENT_READY port=N node=NAME backend=B``), logging JSON to its
own file; it can be stopped (SIGTERM: finishes the op in flight), killed
(SIGKILL), paused and resumed, and restarted on the same node name and state
dir. ``SimWorker`` is a worker process on the SIMULATED device
(``python -m nodeagent.sim.worker``) driven line by line: it holds real bytes
whose checksum it can verify after a snapshot and restore.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tscore.testing.procs import signal_tree, terminate, track, untrack


class AgentProcess:
    def __init__(self, etcd_endpoints: str, prefix: str, node: str, logdir: str, backend: str = "sim",
                 sim_dir: str | os.PathLike | None = None, extra: list[str] | None = None,
                 state_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None):
        self.endpoints, self.prefix, self.node, self.backend = etcd_endpoints, prefix, node, backend
        self.sim_dir = str(sim_dir) if sim_dir else None
        self.state_dir = str(state_dir or os.path.join(logdir, f"agent-{node}-state"))
        self.log_path = os.path.join(logdir, f"nodeagent-{node}.log")
        self.extra = list(extra or [])
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log_start = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "nodeagent.cli", "serve", "--node", self.node,
                "--etcd-endpoints", self.endpoints, "--prefix", self.prefix, "--listen", "127.0.0.1:0",
                "--metrics-port", "-1", "--backend", self.backend, "--state-dir", self.state_dir]
        if self.sim_dir:
            argv += ["--sim-dir", self.sim_dir]
        return argv + self.extra

    def start(self, timeout: float = 30.0) -> "AgentProcess":
        try:
            self._log_start = os.path.getsize(self.log_path)   # a restart appends: read only its lines
        except FileNotFoundError:
            self._log_start = 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        log.close()
        track(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nodeagent {self.node} exited rc={self.proc.returncode}:\n{self.log_tail()}")
            port = self._ready_port()
            if port:
                self.port = port
                return self
            time.sleep(0.05)
        raise TimeoutError(f"nodeagent {self.node} not ready in {timeout}s:\n{self.log_tail()}")

    def _ready_port(self) -> int:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                for line in f:
                    if line.startswith(b"NODEAGENT_READY "):
                        fields = dict(kv.split(b"=", 1) for kv in line.split()[1:])
                        return int(fields[b"port"])
        except FileNotFoundError:
            pass
        return 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is not None:
            terminate([self.proc], grace)
            untrack(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            untrack(self.proc.pid)

    def pause(self) -> None:
        signal_tree(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        signal_tree(self.pid, signal.SIGCONT)

    def restart(self, timeout: float = 30.0) -> "AgentProcess":
        if self.alive():
            self.stop()
        return self.start(timeout)

    def __enter__(self) -> "AgentProcess":
        return self.start() if not self.alive() else self

    def __exit__(self, *exc) -> None:
        if self.alive():
            self.resume()
            self.stop()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self, name: str | None = None, **match) -> list[dict]:
        """Structured log events (all runs of this agent), by ``event`` name and key=value matches."""
        out = []
        try:
            f = open(self.log_path, "rb")
        except FileNotFoundError:
            return out
        with f:
            for line in f:
                if not line.startswith(b"{"):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if (name is None or ev.get("event") == name) and all(ev.get(k) == v for k, v in match.items()):
                    out.append(ev)
        return out

    def wait_events(self, name: str, count: int = 1, timeout: float = 10.0, **match) -> list[dict]:
        """The matching events once there are at least ``count`` of them.

        An agent logs an op's outcome just *after* writing its status, so a
        test that saw the status must wait for the line, not just read.
        """
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events(name, **match)
            if len(evs) >= count:
                return evs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(evs)} of {count} {name} {match} from nodeagent {self.node}:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def wait_event(self, name: str, timeout: float = 10.0, **match) -> dict:
        return self.wait_events(name, 1, timeout, **match)[-1]


class SimWorker:
    """A simulated-GPU worker process (SIMULATOR): ``READY``, then one command per line.

    Commands: ``verify`` (device checksum against the fill: blocks while
    snapshotted), ``checksum``, ``hold <ms>``, ``steps``, ``quit``.
    """

    def __init__(self, sim_dir: str | os.PathLike, nbytes: int, seed: int = 1, step_ms: float = 1.0,
                 env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent.sim.worker", "--sim-dir", str(sim_dir), "--bytes", str(nbytes),
             "--seed", str(seed), "--step-ms", str(step_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True, env={**os.environ, **(env or {})})
        track(self.proc)
        self.pid, self.nbytes, self.expected = self.proc.pid, nbytes, ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def read(self, timeout: float = 10.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.pid} said nothing in {timeout}s") from None
        if line is None:
            raise EOFError(f"worker {self.pid} exited rc={self.proc.wait()}: {self.proc.stderr.read()}")
        return line

    def ready(self, timeout: float = 15.0) -> "SimWorker":
        tag, pid, sha = self.read(timeout).split()
        assert tag == "READY" and int(pid) == self.pid, (tag, pid)
        self.expected = sha
        return self

    def ask(self, cmd: str, timeout: float = 10.0) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
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
