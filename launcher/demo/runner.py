"""The demo driver: runs the two jobs without sharing, then time-sliced, and reports.

    plan = DemoPlan(...)                       # phases, sizes, which runs
    demo = Demo(plan, cluster_doc, out_dir)
    results = demo.run_all()               # per-job progress on stdout
    demo.report(results)                   # the figures table + timeline PNG + summary.json

Runs, in order (each with two fresh job processes):

* ``baseline``: job A runs all its iterations, then job B: no sharing, the
  device idles during every CPU phase;
* ``sliced-swap``: both jobs at once through the cluster; each job's device
  memory is 60% of the (simulated) device, so they cannot sit side by side:
  every handoff snapshots one job to host memory and restores the other;
* ``sliced-coop``: as ``sliced-swap``, but each job's memory is a cooperative
  region (SIMULATED, ``timeslice.sim.coop``): the agent asks the job to move
  it itself, at pinned-copy speed, instead of checkpointing the process;
* ``sliced-elide``: the same with 40% each: both fit, lockd elides the swap
  and a handoff costs only a few etcd round trips.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from timeslice.lockd.report import figures as analysis
from timeslice.lockd.report import timeline
from timeslice.lockd.report.figures import RunFigures

JOBS = (("A", 11), ("B", 22))          # label letter, seed


@dataclass(frozen=True)
class RunSpec:
    key: str
    title: str
    mode: str                  # baseline | sliced
    job_bytes: int
    ballast: bool = False      # real GPU: fill it so that only one job fits (see ballast.py)
    swap: str = "checkpoint"   # checkpoint | cooperative (the job moves its own memory; sim device only)


@dataclass
class DemoPlan:
    iterations: int = 3
    generate_s: float = 1.0
    rewards_s: float = 1.5
    train_s: float = 0.5
    device: str = "sim"        # sim | cuda
    device_desc: str = ""
    group: str = "demo"
    runs: list[RunSpec] = field(default_factory=list)

    def iterations_text(self) -> str:
        return f"{self.iterations} iteration{'s' if self.iterations != 1 else ''}"

    def phases_text(self) -> str:
        return (f"generate {self.generate_s:g}s GPU -> rewards {self.rewards_s:g}s CPU -> "
                f"train {self.train_s:g}s GPU")


def sim_runs(capacity: int, regimes: list[str]) -> list[RunSpec]:
    """Job sizes from the simulated device's capacity: 60% (must swap) and 40% (fits, elided)."""
    swap = int(capacity * 0.6) // 4096 * 4096
    elide = int(capacity * 0.4) // 4096 * 4096
    runs = [RunSpec("baseline", "baseline: one job after the other, no sharing", "baseline", swap)]
    if "swap" in regimes:
        runs.append(RunSpec("sliced-swap", f"time-sliced, swapping (each job {swap / 1e6:.0f} MB "
                            f"of a {capacity / 1e6:.0f} MB device: they do not fit side by side)", "sliced", swap))
    if "coop" in regimes:
        runs.append(RunSpec("sliced-coop", f"time-sliced, cooperative swaps (each job {swap / 1e6:.0f} MB, "
                            "moved by the job itself at PCIe speed)", "sliced", swap, swap="cooperative"))
    if "elide" in regimes:
        runs.append(RunSpec("sliced-elide", f"time-sliced, elided (each job {elide / 1e6:.0f} MB: both fit)",
                            "sliced", elide))
    return runs


class JobProc:
    """A job process: lines from its stdout go to a queue; ``go`` starts it."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, label: str):
        self.label = label
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed by kill()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, text=True, bufsize=1, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None     # both are pipes
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def go(self) -> None:
        self.stdin.write("go\n")
        self.stdin.flush()

    def kill(self) -> None:
        try:
            self.stdin.close()          # a ballast ends when its stdin closes
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.log.close()


class DemoError(RuntimeError):
    pass


class Demo:
    def __init__(self, plan: DemoPlan, cluster: dict, out_dir: Path, say: Callable[[str], None] = print,
                 python: str = sys.executable, run_timeout: float | None = None):
        self.plan, self.cluster, self.out = plan, cluster, Path(out_dir)
        self.say, self.python = say, python
        per_iter = plan.generate_s + plan.rewards_s + plan.train_s
        self.run_timeout = run_timeout or 120.0 + 6 * per_iter * plan.iterations
        (self.out / "events").mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    # -- one run ---------------------------------------------------------------------------
    def _argv(self, spec: RunSpec, letter: str, seed: int, job_id: str, events: Path) -> list[str]:
        p, c = self.plan, self.cluster
        argv = [self.python, "-m", "timeslice.launcher.demo.job", "--job-id", job_id, "--label", f"job {letter}",
                "--mode", spec.mode, "--device", p.device, "--bytes", str(spec.job_bytes), "--seed", str(seed),
                "--iterations", str(p.iterations), "--generate-s", str(p.generate_s),
                "--rewards-s", str(p.rewards_s), "--train-s", str(p.train_s), "--events", str(events),
                "--group", p.group, "--node", c["node"]]
        if p.device == "sim":
            argv += ["--sim-dir", c["sim"]["dir"]]
        if spec.mode == "sliced":
            argv += ["--target", c["target"]]
        if spec.swap != "checkpoint":
            argv += ["--swap", spec.swap]
        return argv

    def run_one(self, spec: RunSpec) -> tuple[RunFigures, dict[str, list[dict]]]:
        p, c = self.plan, self.cluster
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIMESLICE_NODE_NAME": c["node"]}
        if c.get("agent_socket"):
            env["TIMESLICE_AGENT_SOCKET"] = c["agent_socket"]   # the jobs attest their workers there
        if p.device == "sim":
            env["TIMESLICE_SIM_HOST_DIR"] = str(Path(c["sim"]["dir"]) / "host")
        tag = secrets.token_hex(2)
        procs: dict[str, JobProc] = {}
        events: dict[str, Path] = {}
        ev_dir = self.out / "events" / spec.key
        ev_dir.mkdir(parents=True, exist_ok=True)
        for letter, seed in JOBS:
            job_id = f"demo-{letter.lower()}-{spec.key}-{tag}"
            events[job_id] = ev_dir / f"job-{letter}.jsonl"
            events[job_id].unlink(missing_ok=True)
            procs[job_id] = JobProc(self._argv(spec, letter, seed, job_id, events[job_id]), env,
                                    self.out / "logs" / f"{spec.key}-job-{letter}.log", f"job {letter}")
        deadline = time.monotonic() + self.run_timeout
        ballast = None
        try:
            if spec.ballast:
                ballast = self._start_ballast(spec, env, deadline)
            for jp in procs.values():
                self._expect(jp, "READY", deadline)
            t0 = time.time()
            if spec.mode == "baseline":
                for jp in procs.values():          # one after the other
                    jp.go()
                    self._drain(jp, deadline)
            else:
                for jp in procs.values():          # together
                    jp.go()
                self._drain_all(list(procs.values()), deadline)
        finally:
            for jp in procs.values():
                jp.kill()
            if ballast is not None:
                ballast.kill()
            if p.device == "sim":
                self._reap_sim()
        by_job = {}
        for job_id, path in events.items():
            by_job[job_id] = analysis.read_events(path) if path.exists() else []
        starts = [e["t"] for evs in by_job.values() for e in evs if e.get("type") == "start"]
        t0 = min(starts) if starts else t0
        return analysis.figures(spec.key, spec.title, spec.mode, spec.job_bytes, by_job, t0), by_job

    def _start_ballast(self, spec: RunSpec, env: dict, deadline: float) -> JobProc:
        bp = JobProc([self.python, "-m", "timeslice.launcher.demo.ballast", "--job-bytes", str(spec.job_bytes)], env,
                     self.out / "logs" / f"{spec.key}-ballast.log", "ballast")
        line = self._next(bp, deadline)
        if not line or not line.startswith("READY"):
            bp.kill()
            raise DemoError(f"the GPU ballast did not start; see {bp.log.name}")
        _, held, room = line.split()
        self.say(f"    ballast process holds {int(held) / 1e9:.1f} GB of the GPU, leaving "
                 f"{int(room) / 1e9:.1f} GB: room for one job, not two")
        return bp

    def _reap_sim(self) -> None:
        # The simulated device keeps a dead process's files until someone reaps
        # them (a real GPU frees a process's memory when it exits); the jobs of
        # this run are gone, so their leftovers go.
        try:
            from timeslice.common.sim.device import SimDevice
            SimDevice(self.cluster["sim"]["dir"]).reap()
        except OSError:
            pass

    def _expect(self, jp: JobProc, word: str, deadline: float) -> None:
        while True:
            line = self._next(jp, deadline)
            if line is None:
                raise DemoError(f"{jp.label} exited before {word} (rc={jp.proc.wait()}); see {jp.log.name}")
            if line.startswith(word):
                return
            self.say(f"    [{jp.label}] {line}")

    def _next(self, jp: JobProc, deadline: float) -> str | None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DemoError(f"{jp.label} did not finish in time; see {jp.log.name}")
        try:
            return jp.lines.get(timeout=left)
        except queue.Empty:
            raise DemoError(f"{jp.label} did not finish in time; see {jp.log.name}") from None

    def _drain(self, jp: JobProc, deadline: float) -> None:
        while True:
            line = self._next(jp, deadline)
            if line is None:
                break
            self.say(f"    [{jp.label}] {line}")
        rc = jp.proc.wait(max(1.0, deadline - time.monotonic()))
        if rc != 0:
            raise DemoError(f"{jp.label} failed (rc={rc}); see {jp.log.name}:\n{_tail(jp.log.name)}")

    def _drain_all(self, jps: list[JobProc], deadline: float) -> None:
        threads, errors = [], []

        def drain(jp: JobProc) -> None:
            try:
                self._drain(jp, deadline)
            except DemoError as e:
                errors.append(e)

        for jp in jps:
            t = threading.Thread(target=drain, args=(jp,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- all runs ------------------------------------------------------------------------------
    def ensure_group(self) -> None:
        from timeslice.client import OrchestratorClient
        with OrchestratorClient(self.cluster["target"], job_id="timeslice-demo", timeout=20.0) as c:
            c.create_group(self.plan.group, nodes=[self.cluster["node"]])

    def run_all(self) -> list[tuple[RunFigures, dict[str, list[dict]]]]:
        if any(r.mode == "sliced" for r in self.plan.runs):
            self.ensure_group()
        results = []
        for i, spec in enumerate(self.plan.runs, 1):
            self.say(f"\n[{i}/{len(self.plan.runs)}] {spec.title}")
            t = time.monotonic()
            fg, by_job = self.run_one(spec)
            results.append((fg, by_job))
            extra = ""
            if spec.mode == "sliced":
                extra = (f", {fg.swaps} swaps, {fg.elided} elided, {fg.bytes_moved / 1e6:.0f} MB moved, "
                         f"overlapping critical sections: {fg.overlaps}")
            self.say(f"    -> GPU duty cycle {fg.duty:.1%} (busy {fg.gpu_busy_s:.1f}s of {fg.wall_s:.1f}s)"
                     f"{extra}  [{time.monotonic() - t:.0f}s]")
        return results

    def report(self, results: list[tuple[RunFigures, dict[str, list[dict]]]]) -> tuple[str, Path]:
        p = self.plan
        head = ("run", "wall", "GPU busy", "duty cycle", "swaps", "elided", "restores", "bytes moved", "overlaps")
        rows = []
        for fg, _ in results:
            sl = fg.mode == "sliced"
            rows.append((fg.key, f"{fg.wall_s:.1f} s", f"{fg.gpu_busy_s:.1f} s", f"{fg.duty * 100:.1f}%",
                         str(fg.swaps) if sl else "-", str(fg.elided) if sl else "-",
                         str(fg.restores) if sl else "-", f"{fg.bytes_moved / 1e6:.1f} MB" if sl else "-",
                         str(fg.overlaps)))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), *[fmt.format(*r) for r in rows]]
        subtitle = f"{p.iterations_text()} each: {p.phases_text()}; {p.device_desc}"
        png = timeline.draw(results, self.out / "timeline.png", subtitle)
        summary = {"plan": {"iterations": p.iterations, "generate_s": p.generate_s, "rewards_s": p.rewards_s,
                            "train_s": p.train_s, "device": p.device, "device_desc": p.device_desc,
                            "group": p.group},
                   "cluster": {k: self.cluster.get(k) for k in ("run_dir", "target", "node", "backend")},
                   "runs": [fg.to_dict() for fg, _ in results], "timeline": str(png)}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return "\n".join(lines), png


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""
