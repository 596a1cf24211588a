"""A JAX RL-style training job, time-sliced: generate on the GPU, score on the CPU (outside the hold), update on the GPU.

    TIMESLICE_TARGET=... TIMESLICE_JOB_ID=jax-a python -m benchmarks.gpu_jax_job --group rl-gpus --out a.json

Plain JAX, no Flax or optax: a policy over a vocabulary (an embedding as a one-hot matrix
product, residual tanh layers, an output projection) samples ``--batch`` sequences of
``--seq-len`` tokens (``generate``, one ``lax.scan``), a CPU reward scores them (``--reward-s``
seconds of hashing per batch, and the share of generated tokens divisible by 3;
advantages normalised per prompt group, as GRPO does), and a policy-gradient step with a
hand-written Adam updates the parameters (``train_step``: the loss and its gradients;
``optimizer``: Adam). Every kernel is deterministic (no scatter: the embedding and the
log-probabilities are one-hot products; on a GPU ``--xla_gpu_deterministic_ops`` and no
autotuning, see ``XLA_FLAGS`` below), so a run's losses, printed as ``float.hex``, and its
weights' sha256 equal those of the same job run alone, bit for bit.

``--swap`` says how the job is moved while parked: ``cooperative`` (``JaxMemory``, its
parameters and optimizer state named as two regions; the host backup pinned before the
first hold), ``checkpoint`` (the agent checkpoints the whole process: no change to the
loop at all), ``none``. ``--standalone`` runs the same loop with no lock. Without a GPU
(``--device cpu``) the cooperative memory is the SIMULATED device's ``SimJaxMemory``, and
the checkpoint regime gives the job a simulated arena the size of its state for the agent
to move. The job writes one JSON document (``--out``, and its last stdout line).

On a GPU every regime starts XLA with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and
``XLA_PYTHON_CLIENT_ALLOCATOR=platform``, so that freed memory leaves the device and a
checkpoint moves live bytes, not a pool (DESIGN's JAX measurements).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import threading
import time

GPU_XLA_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"   # CI: jobs share 2 cores
ENV_FLAGS = "TIMESLICE_JAX_XLA_FLAGS"              # overrides the flags above (the pair benchmark's preflight)
ENV_BARRIER = "TIMESLICE_EXAMPLE_BARRIER"          # "<dir>:<n>": the loops of n jobs start together


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="rl-gpus")
    ap.add_argument("--standalone", action="store_true")
    ap.add_argument("--swap", choices=["cooperative", "checkpoint", "none"], default="cooperative")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256, help="sequences per step")
    ap.add_argument("--generations", type=int, default=8, help="sequences per prompt (a GRPO group)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--reward-s", type=float, default=2.0, help="CPU seconds per reward call")
    ap.add_argument("--hint-bytes", type=int, default=0, help="device peak (default: measured)")
    ap.add_argument("--stray", action="store_true", help="negative control: the reward reads the weights outside the hold")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def set_up_xla(device: str) -> None:
    """Before JAX starts: the platform, the allocator that returns freed memory, deterministic kernels."""
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    flags = os.environ.get(ENV_FLAGS, GPU_XLA_FLAGS if device == "gpu" else CPU_XLA_FLAGS)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def rendezvous(timeout: float = 300.0) -> None:
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


def burn_cpu(seconds: float) -> int:
    end, n, h = time.monotonic() + seconds, 0, b"reward"
    while time.monotonic() < end:
        for _ in range(2000):
            h = hashlib.sha256(h).digest()
        n += 1
    return n


class Policy:
    """The model and its steps, jitted once (deterministic ops only)."""

    def __init__(self, jax, a):
        self.jax, self.a = jax, a
        jnp = jax.numpy
        V, G = a.vocab, a.generations

        def init(key):
            ks = jax.random.split(key, a.layers + 3)
            scale = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(shape[0])  # noqa: E731
            return {"embed": scale(ks[0], (V, a.dim)), "w_in": scale(ks[1], (a.dim, a.hidden)),
                    "layers": [scale(ks[3 + i], (a.hidden, a.hidden)) for i in range(a.layers)],
                    "w_out": scale(ks[2], (a.hidden, V)) * 0.1}

        def logits(p, tokens):
            h = jnp.tanh(jax.nn.one_hot(tokens, V, dtype=jnp.float32) @ p["embed"] @ p["w_in"])
            for w in p["layers"]:
                h = h + 0.5 * jnp.tanh(h @ w)
            return h @ p["w_out"]

        def generate(p, first, key):
            def one(tok, i):
                nxt = jax.random.categorical(jax.random.fold_in(key, i), logits(p, tok)).astype(jnp.int32)
                return nxt, nxt
            _, seq = jax.lax.scan(one, first, jnp.arange(a.seq_len))
            return jnp.concatenate([first[None], seq], 0).T          # (batch, seq_len + 1)

        def loss(p, seq, adv):
            lp = jax.nn.log_softmax(logits(p, seq[:, :-1].reshape(-1)))
            picked = (lp * jax.nn.one_hot(seq[:, 1:].reshape(-1), V, dtype=jnp.float32)).sum(-1)
            return -(picked.reshape(seq.shape[0], -1).mean(1) * adv).mean()

        def adam(p, o, g):
            b1, b2, eps = 0.9, 0.999, 1e-8
            t = o["t"] + 1
            m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, o["m"], g)
            v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, o["v"], g)
            c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
            p = jax.tree_util.tree_map(lambda p, m, v: p - a.lr * (m / c1) / (jnp.sqrt(v / c2) + eps), p, m, v)
            return p, {"m": m, "v": v, "t": t}

        # Jitted, init too: one compilation each, not one per eager op (dozens, seconds on a busy CPU).
        self.init = jax.jit(init)
        self.opt_init = jax.jit(lambda p: {"m": jax.tree_util.tree_map(jnp.zeros_like, p),
                                           "v": jax.tree_util.tree_map(jnp.zeros_like, p),
                                           "t": jnp.zeros((), jnp.int32)})
        self.generate = jax.jit(generate)
        self.grad = jax.jit(jax.value_and_grad(loss))
        self.adam = jax.jit(adam)
        self.groups = G

    def prompts(self, step: int):
        """One first token per GRPO group, repeated ``generations`` times (deterministic per seed and step)."""
        import numpy as np
        rng = np.random.default_rng([self.a.seed, step])
        return np.repeat(rng.integers(0, self.a.vocab, self.a.batch // self.groups), self.groups).astype(np.int32)

    def score(self, seq) -> tuple:
        """CPU: rewards (the share of generated tokens divisible by 3) and their advantages per group."""
        import numpy as np
        burn_cpu(self.a.reward_s)
        r = (seq[:, 1:] % 3 == 0).mean(1).astype(np.float32)
        g = r.reshape(-1, self.groups)
        adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + np.float32(1e-4))).reshape(-1)
        return r, adv.astype(np.float32)


def digest(jax, *trees) -> str:
    import numpy as np
    h = hashlib.sha256()
    for tree in trees:
        for x in jax.tree_util.tree_leaves(tree):
            h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    a = parse(argv)
    set_up_xla(a.device)
    import jax

    from timeslice import OrchestratorClient
    from timeslice.integrations.slicing import TimeSlice
    client = None if a.standalone else OrchestratorClient()        # target, job id: TIMESLICE_TARGET/_JOB_ID
    swap = "none" if a.standalone else a.swap
    pol = Policy(jax, a)
    key = jax.random.key(a.seed)
    memory = arena = None
    if swap == "cooperative":
        if a.device == "cpu":
            from timeslice.sim.jax_memory import SimJaxMemory
            memory = SimJaxMemory({"params": "offload", "opt_state": "offload"}, os.environ.get("TIMESLICE_SIM_DIR"))
        else:
            from timeslice.integrations.jax import JaxMemory
            memory = JaxMemory({"params": "offload", "opt_state": "offload"})
        shapes = jax.eval_shape(pol.init, key)                      # sizes, before any array exists
        memory.declare("params", shapes)
        memory.declare("opt_state", jax.eval_shape(pol.opt_init, shapes))
    ts = TimeSlice(client, a.group, memory, swap=swap, device_bytes_hint=a.hint_bytes,
                   node=os.environ.get("TIMESLICE_NODE_NAME"))
    if swap == "cooperative":
        ts.register()                                  # before the first hold: the pinning is host work
    state: dict = {}

    def get(tag: str):
        return memory[tag] if memory is not None else state[tag]

    def put(tag: str, tree) -> None:
        if memory is not None:
            memory[tag] = tree
        else:
            state[tag] = tree

    sampler = PeakSampler(jax) if a.device == "gpu" else None
    if sampler is not None:
        sampler.start()
    rendezvous()
    t0 = time.monotonic()
    losses, rewards, stray = [], [], {"calls": 0, "caught": []}
    with sampled(sampler, ts.hold()):                  # the state is made on the device inside the first hold
        params = jax.block_until_ready(pol.init(key))
        put("params", params)
        put("opt_state", jax.block_until_ready(pol.opt_init(params)))
        del params
        if swap == "checkpoint" and a.device == "cpu":
            # SIMULATED: JAX's CPU arrays are not device memory; an arena of the state's size on the
            # simulated device stands for them, for the agent's checkpoint backend to move.
            from timeslice.sim.runtime import SimDeviceClient
            arena = SimDeviceClient.open(os.environ.get("TIMESLICE_SIM_DIR"))
            from timeslice.sim.jax_memory import DEFAULT_CONTEXT_BYTES as ctx
            arena.alloc(state_bytes(jax, get("params"), get("opt_state")) + ctx)   # its context, as SimJaxMemory's
        if swap == "checkpoint":
            ts.register()
    for step in range(a.steps):
        with sampled(sampler, ts.hold()):
            p = get("params")
            with ts.log.span("generate", gpu=True) as ev:
                seq = jax.block_until_ready(pol.generate(p, jax.numpy.asarray(pol.prompts(step)),
                                                         jax.random.fold_in(key, step)))
                ev["tokens"] = int(seq.shape[0] * a.seq_len)
            host_seq = jax.device_get(seq)
            del seq
            with sampled(sampler, ts.released("rewards"), hold=False):   # CPU work: the group is free for the other job
                r, adv = pol.score(host_seq)
                if a.stray:
                    stray["calls"] += 1
                    stray["caught"] += stray_reads(memory, p)
            del p
            p, o = get("params"), get("opt_state")    # read again: a pause may have made new arrays
            with ts.log.span("train_step", gpu=True) as ev:
                loss, g = jax.block_until_ready(pol.grad(p, jax.numpy.asarray(host_seq), jax.numpy.asarray(adv)))
                ev["samples"] = int(host_seq.shape[0])
            with ts.log.span("optimizer", gpu=True):
                p, o = jax.block_until_ready(pol.adam(p, o, g))
            put("params", p)
            put("opt_state", o)
            del p, o, g
            losses.append(float(loss).hex())
            rewards.append(float(r.mean()).hex())
    with sampled(sampler, ts.hold()):                  # the last look at the weights, while holding
        weights = digest(jax, get("params"), get("opt_state"))
        nbytes = state_bytes(jax, get("params"), get("opt_state"))
        regions = memory.region_bytes() if memory is not None else {}
        peak = max(memory.peak_bytes() if memory is not None else 0, device_peak(jax, sampler))
        if a.device == "cpu":                          # on the SIMULATED device: its context and the state
            from timeslice.sim.jax_memory import DEFAULT_CONTEXT_BYTES
            peak = max(peak, nbytes + DEFAULT_CONTEXT_BYTES)
        left = memory.left_behind if memory is not None else None
        stats = memory.backup_stats() if memory is not None else {}
        if arena is not None:
            arena.close()
        ts.finish()
    doc = {"job": client.job_id if client else "standalone", "first_pin": first_pin(ts.log.events, swap), "framework": "jax", "standalone": a.standalone,
           "swap": swap, "device": a.device, "steps": len(losses), "losses": losses, "rewards": rewards,
           "digest": weights, "state_bytes": nbytes, "wall_s": time.monotonic() - t0, "events": ts.log.events,
           "region_bytes": regions, "host_bytes": memory.host_bytes() if memory is not None else 0,
           "peak_bytes": peak, "residues": list(getattr(ts.worker, "residues", [])), "left_behind": left,
           "backup": stats, "swaps": getattr(ts.worker, "swaps", 0), "stray": stray, "warnings": [],
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
    if client is not None:
        client.close()
    text = json.dumps(doc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps({k: doc[k] for k in ("job", "steps", "losses", "digest", "swaps", "stray")}), flush=True)
    sys.stdout.flush()
    return 0


class PeakSampler(threading.Thread):
    """This process's device memory (NVML) every 20 ms while the job holds the group, its maximum kept:
    with the platform allocator XLA keeps no peak of its own, and a benchmark sizes its ballast from
    this one. Only inside holds: NVML's process query made while the agent had this process
    checkpointed (cuda-checkpoint) crashed it with SIGSEGV on the H200, in every regime that parked a
    JAX job (benchmarks/results/gpu_round4.md)."""

    def __init__(self, jax):
        super().__init__(daemon=True)
        from timeslice.integrations.jax import process_device_bytes
        self.dev, self.read, self.peak = jax.devices()[0], process_device_bytes, 0
        self.stop = threading.Event()
        self._on = False
        self._mu = threading.Lock()            # held for each read: off() returns only once none is in flight

    def on(self) -> None:
        with self._mu:
            self._on = True

    def off(self) -> None:
        with self._mu:
            self._on = False

    def run(self) -> None:
        while not self.stop.wait(0.02):
            with self._mu:
                if self._on:
                    self.peak = max(self.peak, self.read(self.dev) or 0)


@contextlib.contextmanager
def sampled(sampler, scope, hold: bool = True):
    """``scope`` with the sampler on inside it (``hold``: a hold), or off inside it (a release within a hold)."""
    if sampler is None:
        with scope:
            yield
        return
    if not hold:                               # off before the release: the agent may park the job at once
        sampler.off()
        with scope:
            yield
        sampler.on()                           # the group is held again
        return
    with scope:                                # on once the hold's memory is back, off before it ends
        sampler.on()
        try:
            yield
        finally:
            sampler.off()


def device_peak(jax, sampler) -> int:
    """The most this process held on its device, as far as XLA and NVML tell (0 on the CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return 0
    stats = dev.memory_stats() or {}
    return max(int(stats.get("peak_bytes_in_use", 0)), sampler.peak if sampler is not None else 0)


def first_pin(events: list[dict], swap: str) -> dict | None:
    """The cooperative job's host backup, reserved at registration: how long, how much, and whether it
    was done before the job first asked for the group (outside any hold, where pinning belongs)."""
    reg = next((e for e in events if e["ev"] == "registered"), None)
    hold = next((e for e in events if e["ev"] == "hold"), None)
    if swap != "cooperative" or reg is None:
        return None
    return {"s": round(reg["seconds"], 4), "host_bytes": reg["host_bytes"],
            "outside_any_hold": hold is not None and reg["t"] <= hold["t_req"]}


def state_bytes(jax, *trees) -> int:
    return sum(int(x.nbytes) for t in trees for x in jax.tree_util.tree_leaves(t) if hasattr(x, "nbytes"))


def stray_reads(memory, kept) -> list[str]:
    """A user mistake, twice: the weights read through the memory, and a reference kept from the hold,
    both used outside it once the agent has taken them away. Each must fail, never compute."""
    end = time.monotonic() + 10
    while memory is not None and not memory.is_paused("params") and time.monotonic() < end:
        time.sleep(0.01)
    caught = []
    for read in (lambda: memory["params"]["w_out"].sum(), lambda: kept["w_out"].sum()):
        try:
            float(read())
        except Exception as e:                         # what the job would have died of
            caught.append(type(e).__name__)
    return caught


if __name__ == "__main__":
    raise SystemExit(main())
