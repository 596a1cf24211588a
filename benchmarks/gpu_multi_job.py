"""One multi-GPU job for benchmarks/gpu_multi.py: a launcher and one rank process per GPU.

The launcher holds the job's session (``OrchestratorClient``), starts its
ranks as children, registers each as a worker on its own GPU
(``gpus=[rank]``) once it owns device memory, and drives the loop
generate (GPU) → rewards (CPU) → train (GPU); every GPU phase runs under
``on_accelerators(group)`` on all ranks at once. A rank, per GPU phase:
verifies its weights' checksum, computes for the phase's length, and runs an
all-reduce whose sum it checks. A rank that does not answer within
``--phase-timeout`` is hung (a broken communicator after a failed restore
never returns): the launcher records it and stops.

Ranks come in two kinds: ``torch`` (CUDA + NCCL through torch.distributed, for
the GPU host) and ``sim`` (the SIMULATED device: real bytes on simulated GPU
``rank``, an all-reduce over loopback TCP run inside a device operation, so it
blocks while the rank is checkpointed; for a dry run of the whole pipeline on
a machine without GPU). Every event is a JSON line in ``--events``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GROUP = "gpus"
NCCL_SAFE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}


# ============================ ranks ======================================================================

class TorchRank:
    """CUDA device ``rank``, NCCL process group over all ranks (torch.distributed)."""

    def __init__(self, a):
        import torch
        self.torch, self.a = torch, a
        self.dev = torch.device("cuda", a.rank)     # no CUDA context yet: that comes under the grant
        self.weights: list = []
        self.side = int((a.scratch_gb * 2**30 / 2 / 2) ** 0.5) // 64 * 64

    def setup(self) -> None:
        import torch.distributed as dist
        t = self.torch
        # The context, the model and the communicator come up inside the first GPU phase, under the grant.
        t.cuda.set_device(self.a.rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{self.a.master_port}", rank=self.a.rank,
                                world_size=self.a.world)
        gen = t.Generator(device=self.dev).manual_seed(1000 * self.a.seed + self.a.rank)
        chunk = 256 * 1024 * 1024 // 4                   # 256 MiB of float32 per tensor
        self.weights = [t.randn(chunk, device=self.dev, generator=gen) for _ in range(max(1, int(self.a.mem_gb * 4)))]

    def checksum(self) -> int:
        t = self.torch
        return int(sum(int(w.view(t.int32).sum(dtype=t.int64).item()) for w in self.weights))

    def compute(self, seconds: float) -> None:
        t = self.torch
        x = t.randn(self.side, self.side, device=self.dev, dtype=t.bfloat16)
        w = t.randn(self.side, self.side, device=self.dev, dtype=t.bfloat16) / self.side ** 0.5
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for _ in range(4):
                x = t.tanh(x @ w)
            t.cuda.synchronize()

    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist
        t = self.torch
        v = t.full((1 << 20,), value, device=self.dev)
        dist.all_reduce(v)
        t.cuda.synchronize()
        first = float(v[0].item())
        return first if bool(t.all(v == first).item()) else float("nan")

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved(self.dev))

    def after_phase(self) -> None:
        if self.a.release_cache:
            self.torch.cuda.empty_cache()

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


class SimRank:
    """SIMULATED GPU ``rank`` (timeslice.common.sim): real bytes; the all-reduce is a loopback TCP sum
    through rank 0, done inside a device operation (it waits while this rank is checkpointed)."""

    UNIT = 1 << 20                                      # --mem-gb counts MiB on the simulator

    def __init__(self, a):
        from timeslice.sim.runtime import SimDeviceClient
        self.a = a
        self.dev = SimDeviceClient.open(a.sim_dir, gpu=a.rank)
        self.nbytes = max(1, int(a.mem_gb * self.UNIT))
        self.peers: list[socket.socket] = []
        self.up: socket.socket | None = None

    def setup(self) -> None:
        import random
        self.dev.alloc(self.nbytes)
        with self.dev.compute() as mem:
            mem[:] = random.Random(1000 * self.a.seed + self.a.rank).randbytes(self.nbytes)
        if self.a.rank == 0:
            srv = socket.create_server(("127.0.0.1", self.a.master_port))
            self.peers = [srv.accept()[0] for _ in range(self.a.world - 1)]
            srv.close()
        else:
            deadline = time.monotonic() + 60
            while True:
                try:
                    self.up = socket.create_connection(("127.0.0.1", self.a.master_port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def checksum(self) -> int:
        return int(self.dev.checksum()[:15], 16)

    def compute(self, seconds: float) -> None:
        import zlib
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            with self.dev.compute() as mem:
                zlib.crc32(mem[: min(self.nbytes, 1 << 16)])
            time.sleep(0.005)

    def all_reduce(self, value: float) -> float:
        with self.dev.compute():
            if self.a.rank == 0:
                total = value + sum(float(_line(p)) for p in self.peers)
                for p in self.peers:
                    p.sendall(f"{total}\n".encode())
                return total
            self.up.sendall(f"{value}\n".encode())
            return float(_line(self.up))

    def reserved(self) -> int:
        return self.dev.device_bytes

    def after_phase(self) -> None:
        pass

    def close(self) -> None:
        for s in [*self.peers, *([self.up] if self.up else [])]:
            s.close()



ENV_BARRIER = "TIMESLICE_MULTI_BARRIER"          # "<dir>:<n>": the loops of n jobs start together


def rendezvous(timeout: float = 120.0) -> None:
    raw = os.environ.get(ENV_BARRIER, "")
    if not raw:
        return
    folder, n = raw.rsplit(":", 1)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    end = time.monotonic() + timeout
    while len(os.listdir(folder)) < int(n):
        if time.monotonic() > end:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {n} jobs reached the barrier in {folder}")
        time.sleep(0.05)

def _line(s: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(64)
        if not chunk:
            raise EOFError("all-reduce peer closed")
        buf += chunk
    return buf.decode().strip()


def rank_main(a) -> int:
    """Commands on stdin (``phase NAME SECONDS`` | ``quit``), one JSON line per answer."""
    r = SimRank(a) if a.sim_dir else TorchRank(a)

    def say(**kw) -> None:
        sys.stdout.write(json.dumps({"rank": a.rank, "pid": os.getpid(), **kw}) + "\n")
        sys.stdout.flush()

    say(ev="started")
    n, expected, ready = 0, 0, False
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "quit":
            break
        if cmd != "phase":
            continue
        t0 = time.monotonic()
        if not ready:
            r.setup()
            expected, ready = r.checksum(), True
        ok = r.checksum() == expected
        r.compute(float(args[1]))
        t_ar = time.monotonic()
        got = r.all_reduce(float(a.rank + 1 + n))          # rank r gives r + 1 + n: the sum is known
        ar_ms = (time.monotonic() - t_ar) * 1000
        want = a.world * n + a.world * (a.world + 1) / 2
        r.after_phase()
        n += 1
        say(ev="phase", phase=args[0], start=t0, end=time.monotonic(), checksum_ok=ok, allreduce_ok=got == want,
            allreduce_ms=round(ar_ms, 2), reserved=r.reserved())
    r.close()
    return 0


# ============================ launcher ===================================================================

class Rank:
    def __init__(self, a, rank: int, master_port: int, env: dict):
        argv = [sys.executable, "-m", "benchmarks.gpu_multi", "--role", "rank", "--rank", str(rank),
                "--world", str(a.gpus), "--master-port", str(master_port), "--seed", str(a.seed),
                "--mem-gb", str(a.mem_gb), "--scratch-gb", str(a.scratch_gb),
                "--release-cache", str(a.release_cache), *(["--sim-dir", a.sim_dir] if a.sim_dir else [])]
        self.rank = rank
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env={**env, **({"TIMESLICE_SIM_GPU": str(rank)} if a.sim_dir else {})},
                                     cwd=ROOT)
        self.pid = self.proc.pid

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"rank {self.rank} exited rc={self.proc.wait()}")
        return json.loads(line)


def gather(ranks: list[Rank], deadline_s: float) -> list[dict]:
    """Every rank's answer, or TimeoutError (a hung all-reduce never answers)."""
    out: list = [None] * len(ranks)

    def one(i: int) -> None:
        try:
            out[i] = ranks[i].read()
        except BaseException as e:
            out[i] = e

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(ranks))]
    for t in ts:
        t.start()
    end = time.monotonic() + deadline_s
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    hung = [r.rank for r, t in zip(ranks, ts) if t.is_alive()]
    if hung:
        raise TimeoutError(f"ranks {hung} did not answer in {deadline_s:.0f}s (a hung all-reduce after a "
                           f"broken restore?)")
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out


def job_main(a) -> int:
    out = open(a.events, "a", buffering=1)

    def rec(**kw):
        out.write(json.dumps({"job": a.job, "t": time.monotonic(), **kw}) + "\n")

    with socket.socket() as s:                       # a free port for this job's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = (ROOT, os.environ.get("PYTHONPATH"))
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if a.nccl_safe:
        env.update(NCCL_SAFE)                        # before NCCL initialises: checkpoint-safe transports
    ranks = [Rank(a, r, port, env) for r in range(a.gpus)]
    for r in ranks:
        r.read()                                     # "started"
    rec(ev="ranks", pids={str(r.pid): r.rank for r in ranks}, nccl_safe=bool(a.nccl_safe))
    client = None
    if a.mode == "sliced":
        from timeslice import OrchestratorClient
        client = OrchestratorClient(target=a.target, job_id=a.job)
    registered = False

    def gpu_phase(name: str, seconds: float) -> None:
        nonlocal registered
        t_req = time.monotonic()
        ctx = client.on_accelerators(GROUP, device_bytes_hint=a.hint_bytes) if client else _Null()
        with ctx as grant:
            t0 = time.monotonic()
            for r in ranks:
                r.send(f"phase {name} {seconds}")
            res = gather(ranks, a.phase_timeout)
            if client is not None and not registered:
                # Registered once they own device memory, by the launcher that started them:
                # one session per job, every rank a worker on its own GPU.
                for r, x in zip(ranks, res):
                    client.register_worker(pid=r.pid, gpus=[r.rank], device_bytes=x["reserved"],
                                           collective=bool(a.collective))
                registered = True
            rec(ev="phase", phase=name, gpu=True, t_req=t_req, start=t0, end=time.monotonic(),
                checksum_ok=all(x["checksum_ok"] for x in res), allreduce_ok=all(x["allreduce_ok"] for x in res),
                allreduce_ms=max(x["allreduce_ms"] for x in res), token=getattr(grant, "token", 0),
                restored=getattr(grant, "restored", False), elided=getattr(grant, "elided", False),
                bytes_moved=getattr(grant, "bytes_moved", 0), waited_ms=getattr(grant, "waited_ms", 0.0))

    rendezvous()
    rc, t_start = 0, time.monotonic()
    try:
        for _ in range(a.iters):
            for name, seconds in (("generate", a.gen_s), ("rewards", a.reward_s), ("train", a.train_s)):
                if name == "rewards":
                    t0 = time.monotonic()
                    time.sleep(seconds)              # rewards: CPU only, GPUs untouched
                    rec(ev="phase", phase=name, gpu=False, start=t0, end=time.monotonic())
                    continue
                try:
                    gpu_phase(name, seconds)
                except TimeoutError as e:
                    rec(ev="hung", phase=name, error=str(e))
                    raise
                except Exception as e:
                    from timeslice.errors import SwapFailedError
                    if not isinstance(e, SwapFailedError):
                        raise
                    rec(ev="acquire_failed", phase=name, error=str(e)[:2000])
                    time.sleep(a.gen_s)
    except Exception as e:
        rec(ev="error", error=f"{type(e).__name__}: {str(e)[:2000]}")
        rc = 1
    rank_rcs: list = []
    for r in ranks:
        try:
            r.send("quit")
            rank_rcs.append(r.proc.wait(20))
        except (OSError, subprocess.TimeoutExpired):
            r.proc.kill()
            rank_rcs.append(r.proc.poll() if r.proc.poll() is not None else "killed")
    # Every rank's exit code is the job's record: a rank that died makes the job fail.
    rec(ev="done", wall=time.monotonic() - t_start, rank_exit_codes=rank_rcs)
    if client is not None:
        client.close()
    return rc or int(any(rank_rcs))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
