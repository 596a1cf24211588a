"""One synthetic RL job of the demo: ``python -m timeslice.launcher.demo.job ...``.

Each iteration is the loop of a GRPO-style trainer, with fixed phase lengths:

    generate (GPU)  ->  rewards (CPU)  ->  train (GPU)

``--mode baseline`` runs it alone, holding the device throughout, as a job
does without time-slicing. ``--mode sliced`` wraps the two GPU phases in
``@orchestrator.on_accelerators(group_id=...)``, so the job holds the group
only while it computes and another job's context can be restored onto the
device meanwhile. Nothing else in the loop changes.

Talking to the demo driver: the job prints ``READY`` once set up and waits
for ``go`` on stdin (so both jobs start together), prints one human line per
iteration, and ``DONE`` at the end. Every phase is also written, as one JSON
object a line, to ``--events``: its start and end (wall clock), and for GPU
phases the grant (token, restored, elided, bytes moved, wait) and whether
the device bytes verified after a restore.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from typing import TYPE_CHECKING, cast

from timeslice.common import swaps

if TYPE_CHECKING:
    from timeslice import OrchestratorClient
    from timeslice.launcher.demo.devices import SimCoopGpu, SimGpu, TorchGpu


def _size(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


class Job:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.events = open(a.events, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        self.grant = None
        self.client: OrchestratorClient | None = None
        self.gpu: TorchGpu | SimCoopGpu | SimGpu
        if a.device == "cuda":
            from timeslice.launcher.demo.devices import TorchGpu
            self.gpu = TorchGpu(a.bytes, a.seed)
        elif a.swap == swaps.COOPERATIVE:
            from timeslice.launcher.demo.devices import SimCoopGpu
            self.gpu = SimCoopGpu(a.sim_dir, a.bytes, a.seed)
        else:
            from timeslice.launcher.demo.devices import SimGpu
            self.gpu = SimGpu(a.sim_dir, a.bytes, a.seed)
        self.bad_verifies = 0
        self.verifies = 0
        self.final_ok = True
        self.line: list[str] = []

    def emit(self, **ev) -> None:
        ev.setdefault("job", self.a.job_id)
        ev.setdefault("label", self.a.label)
        self.events.write(json.dumps(ev, sort_keys=True) + "\n")

    def say(self, text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    # -- the phases --------------------------------------------------------------------
    def _on_grant(self, grant) -> None:
        self.grant = grant                   # after_acquire: the Acquire reply of this hold

    def gpu_phase(self, name: str, it: int, seconds: float) -> dict:
        """The body of a GPU phase; in sliced mode it runs while the job holds the group."""
        t_start = time.time()
        grant, self.grant = self.grant, None
        first = not self.gpu.allocated
        if first:
            # Device memory is taken while holding the group, as a real job
            # allocates on the GPU it was granted; then the worker is
            # registered, so that the node agent can snapshot it.
            self.gpu.allocate()
            if self.client is not None and self.a.swap == swaps.COOPERATIVE:
                self.client.cooperate(cast("SimCoopGpu", self.gpu).memory, node=self.a.node)
                self._wait_reported()
            elif self.client is not None:
                self.client.register_worker(pid=os.getpid(), node=self.a.node, device_bytes=self.gpu.nbytes)
                self._wait_reported()
        verified = None
        if grant is not None and grant.restored:
            verified = self.gpu.verify()
            self.verifies += 1
            if not verified:
                self.bad_verifies += 1
        left = seconds - (time.time() - t_start)
        self.gpu.work(max(0.0, left))
        last = name == "train" and it == self.a.iterations - 1
        if last:
            self.finish()
        t_end = time.time()
        ev = {"type": "phase", "phase": name, "iter": it, "gpu": True, "t_start": t_start, "t_end": t_end,
              "allocated": first, "verified": verified}
        if grant is not None:
            ev.update(token=grant.token, restored=grant.restored, elided=grant.elided,
                      bytes_moved=grant.bytes_moved, waited_ms=grant.waited_ms, epoch=grant.leader_epoch)
        return ev

    def finish(self) -> None:
        """End of training, still holding the device: check every byte, free the device memory
        and unregister the worker, so the next job's context goes where ours was without a
        snapshot of a job that is about to exit."""
        self.final_ok = self.gpu.verify()
        self.gpu.free()
        if self.client is not None:
            self.client.unregister_worker(pid=os.getpid(), node=self.a.node)

    def _reported_free(self) -> tuple[int, int] | None:
        """(free, total) device bytes of our node as the agent last reported them, via lockd."""
        assert self.client is not None, "only a sliced job asks lockd"
        st = self.client.status(self.a.group)
        mine = [n for n in st.node_status if n.node == self.a.node and n.agent_alive]
        return (mine[0].device_free_bytes, mine[0].device_total_bytes) if mine else None

    def _wait_reported(self, timeout: float = 5.0) -> None:
        """Wait until the node agent's report of free device memory counts our new bytes.

        lockd decides whether the next job fits beside us from the agent's last
        report; the agent re-reports when a worker registers, a few
        milliseconds later. A job that yielded within those milliseconds would
        let the next one in beside it although it does not fit (and its
        allocation would fail), so the demo waits for the report.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self._reported_free()
            if got is not None:
                free, total = got
                actual = self.gpu.device_free()
                if free <= (actual if actual is not None else total - self.gpu.nbytes):
                    return
            time.sleep(0.02)
        sys.stderr.write(f"demo job {self.a.job_id}: the agent did not report our {self.gpu.nbytes} bytes "
                         f"within {timeout}s\n")

    def rewards(self, it: int, seconds: float) -> None:
        # A stand-in reward model on the CPU: a little real work, then the rest
        # of the phase asleep, so the demo's timing does not depend on free cores.
        t_start = time.time()
        blob = (self.a.job_id * 4096).encode()
        for _ in range(20):
            zlib.crc32(blob)
        time.sleep(max(0.0, seconds - (time.time() - t_start)))
        self.emit(type="phase", phase="rewards", iter=it, gpu=False, t_start=t_start, t_end=time.time())
        self.line.append(f"rewards {seconds:.1f}s")

    def run_gpu(self, fn, name: str, it: int, seconds: float) -> None:
        t_req = time.time()
        ev = fn(name, it, seconds)
        ev.update(t_request=t_req, t_released=time.time())
        self.emit(**ev)
        part = f"{name} {ev['t_end'] - ev['t_start']:.1f}s"
        extra: list[str] = []
        if self.client is not None:
            extra.append(f"waited {ev['t_start'] - t_req:.2f}s")
            if ev.get("restored"):
                extra.append("restored" + (" ok" if ev.get("verified") else " CHECKSUM MISMATCH"))
            if ev.get("bytes_moved"):
                extra.append(f"{_size(ev['bytes_moved'])} moved")
            if ev.get("elided"):
                extra.append("swap elided")
        self.line.append(part + (f" ({', '.join(extra)})" if extra else ""))

    # -- the loop ------------------------------------------------------------------------------
    def main(self) -> int:
        a = self.a
        gpu_phase = self.gpu_phase
        if a.mode == "sliced":
            from timeslice import OrchestratorClient
            orchestrator = self.client = OrchestratorClient(target=a.target, job_id=a.job_id,
                                                            after_acquire=self._on_grant)
            orchestrator.open_session()
            hint = self.gpu.hint_bytes
            # The whole change a job needs: its GPU phases hold the group.
            generate = orchestrator.on_accelerators(group_id=a.group, device_bytes_hint=hint)(gpu_phase)
            train = orchestrator.on_accelerators(group_id=a.group, device_bytes_hint=hint)(gpu_phase)
        else:
            generate = train = gpu_phase
        self.say("READY")
        if sys.stdin.readline().strip() != "go":
            return 1
        self.emit(type="start", t=time.time(), mode=a.mode, bytes=self.gpu.nbytes, device=self.gpu.kind)
        for it in range(a.iterations):
            self.line = []
            self.run_gpu(generate, "generate", it, a.generate_s)
            self.rewards(it, a.rewards_s)
            self.run_gpu(train, "train", it, a.train_s)
            self.say(f"iteration {it + 1}/{a.iterations}: " + ", ".join(self.line))
        ok = self.final_ok
        self.emit(type="end", t=time.time(), final_verify=ok, verifies=self.verifies, bad_verifies=self.bad_verifies)
        if self.client is not None:
            self.client.close()
        self.say(f"DONE verified={self.verifies} mismatches={self.bad_verifies} final={'ok' if ok else 'BAD'}")
        return 0 if ok and not self.bad_verifies else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a synthetic RL job (timeslice demo)")
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--mode", choices=["baseline", "sliced"], required=True)
    ap.add_argument("--device", choices=["sim", "cuda"], default="sim")
    ap.add_argument("--sim-dir", default=None)
    ap.add_argument("--bytes", type=int, required=True, help="the job's device memory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--generate-s", type=float, default=1.0)
    ap.add_argument("--rewards-s", type=float, default=1.5)
    ap.add_argument("--train-s", type=float, default=0.5)
    ap.add_argument("--target", default=None)
    ap.add_argument("--group", default="demo")
    ap.add_argument("--node", default=None)
    ap.add_argument("--events", required=True)
    ap.add_argument("--swap", choices=sorted(swaps.job_kinds()), default=swaps.CHECKPOINT,
                    help="cooperative: the job's memory is a SIMULATED cooperative region it moves itself")
    a = ap.parse_args(argv)
    from timeslice.common.server import logs
    logs.configure("demo-job", "warning", json=False, stream=sys.stderr)
    return Job(a).main()


if __name__ == "__main__":
    sys.exit(main())
