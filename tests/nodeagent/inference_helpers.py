"""Start the SIMULATED inference server (``timeslice.testing.standin.server``) as a real process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path


class SimServer:
    def __init__(self, sim_dir: Path, flavor: str, regions: list[str], port: int = 0,
                 context: str = "1MiB", token_ms: float = 5.0):
        args = [sys.executable, "-m", "timeslice.testing.standin.server", "--flavor", flavor,
                "--sim-dir", str(sim_dir), "--port", str(port), "--context-bytes", context,
                "--token-ms", str(token_ms)]
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

    def requests(self) -> dict:
        return self.get("/sim/requests")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


class Request:
    """One generate request sent on its own thread; ``result()`` is (HTTP status, JSON body)."""

    def __init__(self, srv: SimServer, tokens: int):
        import threading
        self._out: list[tuple[int, dict]] = []
        if srv.ready["flavor"] == "vllm":
            path, doc = "/v1/completions", {"prompt": "p", "max_tokens": tokens}
        else:
            path, doc = "/generate", {"text": "p", "sampling_params": {"max_new_tokens": tokens}}
        self._t = threading.Thread(target=self._send, args=(srv.url + path, doc), daemon=True)
        self._t.start()

    def _send(self, url: str, doc: dict) -> None:
        import urllib.error
        req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                self._out.append((r.status, json.loads(r.read() or b"{}")))
        except urllib.error.HTTPError as e:
            self._out.append((e.code, json.loads(e.read() or b"{}")))
        except OSError as e:           # the server went away
            self._out.append((0, {"error": str(e)}))

    def result(self, timeout: float = 30.0) -> tuple[int, dict]:
        self._t.join(timeout)
        if not self._out:
            raise TimeoutError("the request did not finish")
        return self._out[0]

    def finish_reason(self, timeout: float = 30.0) -> str:
        status, doc = self.result(timeout)
        if status != 200:
            return f"HTTP {status}: {doc.get('error', '')}"
        if "choices" in doc:
            return doc["choices"][0]["finish_reason"]
        return doc["meta_info"]["finish_reason"]["type"]
