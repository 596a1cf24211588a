"""Start the SIMULATED inference server (``nodeagent.sim.inference_server``) as a real process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path


class SimServer:
    def __init__(self, sim_dir: Path, flavor: str, regions: list[str], port: int = 0,
                 context: str = "1MiB"):
        args = [sys.executable, "-m", "timeslice.nodeagent.sim.inference_server", "--flavor", flavor,
                "--sim-dir", str(sim_dir), "--port", str(port), "--context-bytes", context]
        for r in regions:
            args += ["--region", r]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stand-in server did not start: {self.proc.stderr.read()[-2000:]}")
        self.ready = json.loads(line)
        self.pid, self.port = self.ready["pid"], self.ready["port"]
        self.url = f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read() or b"{}")

    def post(self, path: str, doc: dict) -> None:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()

    def memory(self) -> dict:
        return self.get("/sim/memory")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
