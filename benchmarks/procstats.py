"""Process accounting for the benchmarks: CPU seconds and memory of the measured processes
(lockd replicas, etcd members, the client), how busy the whole machine was, and optional
py-spy profiles of the Python ones.

Read from /proc (stat(5), statm) by hand: a few fields, Linux only, as the benchmarks are.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (its threads included), seconds; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK   # fields 14, 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return round(int(f.read().split()[1]) * _PAGE / 2**20, 1)
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)            # idle + iowait
    total = sum(vals[:8])                                          # guest time is inside user already
    return total - idle, total


class CpuMeter:
    """CPU seconds used by named processes between ``start()`` and ``stop()``.

    Also how busy the whole machine was (all cores, everyone's processes), so a
    reader can tell "lockd is slow" from "the box was saturated by other work".
    """

    def __init__(self, pids: dict[str, int]):
        self.pids = dict(pids)
        self._t0 = 0.0
        self._c0: dict[str, float] = {}
        self.result: dict[str, dict] = {}

    def start(self) -> CpuMeter:
        self._t0 = time.monotonic()
        self._c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self._m0 = _machine_ticks()
        self._load0 = os.getloadavg()[0]
        return self

    def stop(self) -> dict[str, dict]:
        wall = time.monotonic() - self._t0
        self.result = {n: {"pid": p, "cpu_s": round(cpu_seconds(p) - self._c0[n], 2),
                           "cpu_pct_of_one_core": round(100 * (cpu_seconds(p) - self._c0[n]) / wall, 1),
                           "rss_mb": rss_mb(p)} for n, p in self.pids.items()}
        (b0, t0), (b1, t1) = self._m0, _machine_ticks()
        ours = sum(v["cpu_s"] for v in self.result.values())
        self.machine = {"machine_busy_pct_all_cores": round(100 * (b1 - b0) / max(t1 - t0, 1), 1),
                        "cores": os.cpu_count(),
                        "measured_processes_cpu_pct_of_all_cores": round(100 * ours / wall / os.cpu_count(), 1),
                        "loadavg_1min_start_end": [self._load0, os.getloadavg()[0]]}
        return self.result


# --- optional profiling of the lockd processes (py-spy) -----------------------

class SpyRecorder:
    """``py-spy record`` on some processes for a fixed window (``--py-spy DIR`` of a benchmark).

    py-spy is not a project dependency: install it into the venv to use this
    (``.venv/bin/pip install py-spy``). Output: DIR/<name>.txt in py-spy's raw
    (collapsed stack) format; summarise with ``python -m benchmarks.spy_summary``.
    """

    def __init__(self, outdir: str | None, pids: dict[str, int], seconds: float, rate: int = 200):
        self.outdir, self.pids, self.seconds, self.rate = outdir, pids, seconds, rate
        self.procs: list[subprocess.Popen] = []

    def start(self) -> SpyRecorder:
        if not self.outdir:
            return self
        os.makedirs(self.outdir, exist_ok=True)
        exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
        for name, pid in self.pids.items():
            if name.startswith("etcd"):
                continue                   # not a Python process
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            self.procs.append(subprocess.Popen(
                [exe, "record", "-p", str(pid), "-d", str(max(1, int(self.seconds))), "-r", str(self.rate),
                 "-f", "raw", "--nonblocking", "-o", os.path.join(self.outdir, f"{safe}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def wait(self) -> None:
        for p in self.procs:
            try:
                p.wait(self.seconds + 30)
            except subprocess.TimeoutExpired:
                p.kill()
