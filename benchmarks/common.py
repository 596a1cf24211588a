"""What every benchmark shares: the stack under test, the raw job client, statistics,
machine facts, tables and result files.

The stack is the test harness's etcd and lockd (the launcher's processes, with the
harness's kill/pause for the failover benchmark). The job client is the raw-stub
one the chaos clients use too (``timeslice.testing.rawjob``: the generated gRPC stubs
only, no client library, so the overhead a benchmark measures is the RPC itself;
on UNAVAILABLE it re-sends the same call to the next replica).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import uuid

import grpc

from timeslice.auth import metadata_for
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig
from timeslice.proto import lockd_pb2 as pb
from timeslice.testing import rawjob
from timeslice.testing.etcd import EtcdCluster
from timeslice.testing.lockd import LockdCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
_LOAD_AT_IMPORT = os.getloadavg()   # this module is imported when a benchmark starts
SHARED_CORES_NOTE = ("client, lockd replicas and etcd all run on this one machine and share its "
                     "{n} CPU core(s); every figure includes that contention")


# --- statistics ---------------------------------------------------------------

def percentile(sorted_vals: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list (p in [0, 100])."""
    if not sorted_vals:
        return float("nan")
    k = max(0, min(len(sorted_vals) - 1, round(p / 100 * len(sorted_vals) + 0.5) - 1))
    return sorted_vals[k]


def summarize(vals: list[float]) -> dict:
    """n, min, p50, p90, p99, max, mean of ``vals`` (same unit as given), rounded to 3 places."""
    s = sorted(vals)
    if not s:
        return {"n": 0}
    out = {"n": len(s), "min": s[0], "p50": percentile(s, 50), "p90": percentile(s, 90),
           "p99": percentile(s, 99), "max": s[-1], "mean": sum(s) / len(s)}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


# --- machine facts and result files ------------------------------------------

def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    etcd_v = _run(["etcd", "--version"]).splitlines()
    commit = _run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
    dirty = bool(_run(["git", "-C", ROOT, "status", "--porcelain", "--", "lockd", "common", "proto"]))
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "loadavg_at_start": _LOAD_AT_IMPORT,
        "loadavg_at_end": os.getloadavg(),
        "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "etcd": etcd_v[0].split(":", 1)[1].strip() if etcd_v else "unknown",
        "git_commit": commit + ("+dirty" if dirty else ""),
        "etcd_data_dir": os.environ.get("TIMESLICE_ETCD_TMPDIR") or "/dev/shm (tmpfs: no disk fsync)",
    }


def command_line(module: str, argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *map(shlex.quote, argv)])


def write_result(name: str, command: str, params: dict, figures: dict, **extra) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    doc = {"benchmark": name, "command": command,
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_facts(),
           "note": SHARED_CORES_NOTE.format(n=os.cpu_count()),
           "params": params, "figures": figures, **extra}
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    return path


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *map(line, cells[1:])])


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


# --- the stack under test -----------------------------------------------------

class Stack:
    """``etcd_size`` etcd members plus ``replicas`` lockd processes on one fresh prefix."""

    def __init__(self, etcd_size: int = 1, replicas: int = 3, lockd_args: list[str] | None = None):
        self.etcd_size, self.n, self.lockd_args = etcd_size, replicas, list(lockd_args or [])
        self.prefix = f"/bench-{uuid.uuid4().hex[:8]}/"
        self.etcd: EtcdCluster | None = None
        self.lockd: LockdCluster | None = None
        self._counter: EtcdClient | None = None

    def start(self) -> Stack:
        self.etcd = EtcdCluster(size=self.etcd_size).start()
        try:
            self.lockd = LockdCluster(self.etcd.endpoints_str, self.prefix, n=self.n,
                                      extra=self.lockd_args).start()
            self.lockd.leader(self.etcd)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._counter = None           # its channel dies with the event loop that made it
        if self.lockd is not None:
            self.lockd.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def roles(self):
        """(leader, [followers]) as LockdProcess objects."""
        lead, _ = self.lockd.leader(self.etcd)
        return lead, [r for r in self.lockd.replicas if r is not lead and r.alive()]

    def pids(self) -> dict[str, int]:
        lead, _ = self.lockd.leader(self.etcd)
        out = {f"lockd-{r.replica_id}{'(leader)' if r is lead else ''}": r.pid
               for r in self.lockd.replicas if r.alive()}
        out.update({f"etcd-{m.name}": m.pid for m in self.etcd.members if m.is_running()})
        return out

    async def etcd_counts(self) -> tuple[int, int]:
        """(keys under the prefix, current store revision): one count-only range request."""
        if self._counter is None:
            self._counter = EtcdClient(EtcdConfig.parse(self.etcd.endpoints_str))
        r = await self._counter.range(ops.range_req(self.prefix.encode(), prefix=True, count_only=True))
        return int(r.count), int(r.header.revision)


# --- the raw-stub job client (timeslice.testing.rawjob, shared with the chaos clients) ----

Channels, GiveUp, Job = rawjob.Channels, rawjob.GiveUp, rawjob.RawJob


async def create_group(stub_or_job, group: str, nodes: tuple[str, ...] = ("bench-node",)) -> None:
    """Create ``group`` on nodes that run no agent and no workers: nothing ever moves."""
    stub = stub_or_job
    if isinstance(stub_or_job, Job):
        stub = stub_or_job.channels.stub(stub_or_job.target)
    await stub.CreateGroup(pb.CreateGroupRequest(group_id=group, nodes=[pb.NodeSpec(node=n) for n in nodes]),
                           timeout=10, metadata=metadata_for("CreateGroup"))


def now() -> float:
    return time.monotonic()
