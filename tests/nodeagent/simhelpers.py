"""Helpers for the node agent's backend tests: real simulated-GPU worker processes
(``python -m timeslice.sim.worker``) driven over pipes, a fake meminfo, polling."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20


class Worker:
    """A simulated-GPU worker subprocess, driven line by line over stdin/stdout."""

    def __init__(self, sim_dir: Path, nbytes: int, seed: int, step_ms: float = 1.0, gpu: int | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timeslice.sim.worker", "--sim-dir", str(sim_dir),
             "--bytes", str(nbytes), "--seed", str(seed), "--step-ms", str(step_ms),
             *(["--gpu", str(gpu)] if gpu is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.nbytes = nbytes
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.expected = None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def read(self, timeout: float = 10.0) -> str:
        line = self._lines.get(timeout=timeout)
        if line is None:
            raise EOFError(f"worker {self.pid} exited: rc={self.proc.wait()} stderr={self.proc.stderr.read()}")
        return line

    def ready(self, timeout: float = 15.0) -> Worker:
        line = self.read(timeout)
        tag, pid, sha = line.split()
        assert tag == "READY" and int(pid) == self.pid, line
        self.expected = sha
        return self

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str, timeout: float = 10.0) -> str:
        self.send(cmd)
        return self.read(timeout)

    def steps(self) -> int:
        return int(self.ask("steps").split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=1)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def write_meminfo(root: Path, available_kib: int, total_kib: int = 64 << 20) -> None:
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        {available_kib // 2} kB\n"
        f"MemAvailable:   {available_kib} kB\nBuffers:          1024 kB\nCached:        1000 kB\n"
        "HugePages_Total:       0\nHugepagesize:       2048 kB\n")


def wait_until(pred, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
