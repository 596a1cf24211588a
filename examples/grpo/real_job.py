"""A plain PyTorch/transformers GRPO loop, time-sliced with the decorator: a real model, real steps.

    TIMESLICE_JOB_ID=job-a python examples/grpo/real_job.py --group local   # beside `timeslice up` (elsewhere: its exports)

The seeds' loop with a real model: ``generate_phase`` (transformers ``generate``,
sampling), ``compute_rewards`` (on the CPU), ``train_phase`` (log-probs, a
group-relative policy-gradient loss, backward, an AdamW step). The two GPU phases
carry ``@orchestrator.on_accelerators``; between them the job holds nothing.
``ModelRegions`` puts the model and the optimizer state (which AdamW creates at its
first step) into the cooperative memory's regions: torch-memory-saver's on a CUDA
device, the SIMULATED device's ``SimTorchMemory`` without one (it overwrites them
with NaN while the job is parked, so a phase run outside its hold shows).

``--standalone`` runs the same loop with no lock. Prints (and writes to ``--out``)
one JSON document: exact per-step losses, the final weights' sha256, the holds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # before CUDA starts: deterministic cuBLAS
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import realmodel as R


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="rl-gpus")
    ap.add_argument("--standalone", action="store_true", help="no lock: the same loop alone")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto (default: %(default)s)")
    ap.add_argument("--size", default="tiny", choices=sorted(R.SIZES))
    ap.add_argument("--dtype", default="float32", help="the weights' dtype (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=8)
    ap.add_argument("--reward-s", type=float, default=0.2, help="CPU seconds per reward call")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hint-bytes", type=int, default=0,
                    help="the job's device peak for lockd (default: weights + AdamW state from the config, "
                         "plus gradients and --activations-gib on CUDA)")
    ap.add_argument("--activations-gib", type=float, default=2.0, help="CUDA: room for activations in the hint")
    ap.add_argument("--generation", choices=R.GENERATIONS, default="eager",
                    help="eager: transformers' generate (default); dense: static KV cache and a CUDA-graph decode "
                         "step (not yet proven on a GPU: benchmarks/results/gpu_round4.md)")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


class Holds:
    """Every hold in the job's phase log (the client's hooks call it), as TimeSlice writes them."""

    def __init__(self, log):
        self.log, self.open = log, {}

    def granted(self, grant=None) -> None:
        now = time.monotonic()
        self.open = {"t_req": now - (grant.waited_ms / 1000 if grant else 0), "t_grant": now, "grant": grant}

    def yielding(self, grant=None) -> None:
        g, held = grant or self.open.get("grant"), self.open
        self.log.add("hold", t_req=held.get("t_req", 0), t_grant=held.get("t_grant", 0), t_release=time.monotonic(),
                     token=getattr(g, "token", 0), restored=getattr(g, "restored", False),
                     elided=getattr(g, "elided", False), bytes_moved=getattr(g, "bytes_moved", 0),
                     waited_ms=getattr(g, "waited_ms", 0.0))


class Alone(contextlib.ContextDecorator):
    """``on_accelerators`` for a standalone run: no lock, the same cache release as a yield."""

    def __init__(self, holds: Holds):
        self.holds = holds

    def __enter__(self):
        self.holds.granted()

    def __exit__(self, *exc):
        from timeslice import release_framework_cache
        release_framework_cache()
        self.holds.yielding()
        return False


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from timeslice import OrchestratorClient
    from timeslice.integrations.pytorch import ModelRegions
    from timeslice.integrations.slicing import PhaseLog

    nondeterministic = R.deterministic()
    device = R.pick_device(a.device)
    log = PhaseLog(sync=device == "cuda")
    holds = Holds(log)
    orchestrator = None if a.standalone else OrchestratorClient(after_acquire=holds.granted,
                                                                 before_yield=holds.yielding)
    memory = None
    if not a.standalone and device == "cpu":
        memory = R.sim_memory()
    elif device == "cuda":
        from timeslice.torch_memory import TorchMemory
        memory = TorchMemory(R.TAGS)
    def grew(tag: str, seconds: float) -> None:       # a region grew; its backup was pinned then
        log.add("region", tag=tag, bytes=memory.region_bytes().get(tag, 0), pin_s=seconds)
    # Clean between steps: a pause after a generate hold copies nothing out (the weights and the
    # optimizer state are written by the step only); one after a train hold copies both.
    place = ModelRegions(memory, on_grow=grew, clean_between_steps=True) if memory is not None else None
    if orchestrator is not None and memory is not None:
        # Cooperate before the first hold, the regions' sizes expected from the config: the host
        # backup is pinned on a thread of its own (weights first: the first pause needs them) while
        # the job builds its model and generates; the first pause waits for it only if it is not done.
        for tag, n in R.region_sizes(a.size, a.dtype).items():
            place.expect(tag, n)
        t = time.monotonic()
        place.worker = orchestrator.cooperate(memory, node=os.environ.get("TIMESLICE_NODE_NAME"),
                                              prepin="background")
        log.add("registered", swap="cooperative", seconds=time.monotonic() - t, held=False)
    # lockd needs the peak before the job reaches it (AdamW makes its state at the first step):
    hint = a.hint_bytes or R.footprint(a.size, a.dtype) + getattr(memory, "context_bytes", 0)
    if a.generation == "dense" and not a.hint_bytes:         # the static cache of the dense generator
        hint += R.dense_bytes(a.size, a.prompts * a.generations, a.prompt_len + a.completion_len, a.dtype)
    if device == "cuda" and not a.hint_bytes:
        hint += R.footprint(a.size, a.dtype) // 3 + int(a.activations_gib * (1 << 30))   # gradients, activations
    tok = R.tokenizer(R.SIZES[a.size][5])
    job = {"model": None, "optimizer": None, "dense": None}

    def on_accelerators(group_id: str):
        if orchestrator is None:
            return Alone(holds)
        return orchestrator.on_accelerators(group_id=group_id, device_bytes_hint=hint)

    def load() -> None:                               # inside the first hold: the device is ours
        region = memory.region("weights") if memory is not None else contextlib.nullcontext()
        with region:
            model = R.build_model(a.size, device, a.seed, a.dtype)
        model = place.module(model) if place else model
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        job.update(model=model, optimizer=place.optimizer(opt) if place else opt,
                   dense=R.dense(model, memory, place.adopt if place else None, a.generation))
        torch.manual_seed(a.seed)                     # the sampling stream, from here on

    @on_accelerators(group_id=a.group)
    def generate_phase(prompts: list[str]) -> list[tuple[list[int], list[int]]]:
        if job["model"] is None:
            load()
        model = job["model"]
        enc = tok(prompts, return_tensors="pt").to(device)   # equal-length prompts: no padding
        with log.span("generate", gpu=True) as ev, torch.no_grad():
            out = model.generate(**enc, do_sample=True, max_new_tokens=a.completion_len,
                                 num_return_sequences=a.generations, pad_token_id=R.PAD, eos_token_id=R.EOS)
            n = enc["input_ids"].shape[1]
            rows = out.cpu().tolist()                 # what leaves the hold is on the CPU
            done = [(row[:n], cut(row[n:])) for row in rows]
            ev.update(sequences=len(done), tokens=sum(len(c) for _p, c in done))
        return done

    def compute_rewards(rollouts) -> list[float]:     # the CPU: the GPU is free for another job
        with log.span("rewards", gpu=False):
            R.burn_cpu(a.reward_s)
            return [R.reward_of(c) for _p, c in rollouts]

    @on_accelerators(group_id=a.group)
    def train_phase(rollouts, rewards: list[float]) -> float:
        with log.span("train_step", gpu=True, samples=len(rollouts)):
            return train(rollouts, rewards)

    def train(rollouts, rewards: list[float]) -> float:
        model, opt = job["model"], job["optimizer"]
        r = torch.tensor(rewards).view(-1, a.generations)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).to(device)
        width = max(len(c) for _p, c in rollouts)
        ids = torch.tensor([p + c + [R.PAD] * (width - len(c)) for p, c in rollouts], device=device)
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for _p, c in rollouts], device=device)
        n = len(rollouts[0][0])
        logits = model(input_ids=ids).logits[:, n - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, n:, None]).squeeze(-1)
        loss = -((logp * mask).sum(1) / mask.sum(1).clamp(min=1) * adv).mean()
        loss.backward()
        with log.span("optimizer", gpu=True):
            opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    R.rendezvous()
    t0 = time.monotonic()
    prompts = R.prompts(a.steps * a.prompts, a.prompt_len, a.seed)
    losses = []
    for step in range(a.steps):
        rollouts = generate_phase(prompts[step * a.prompts:(step + 1) * a.prompts])
        losses.append(train_phase(rollouts, compute_rewards(rollouts)))
    with on_accelerators(group_id=a.group):           # the last look at the weights, while holding
        digest = R.weights_digest(job["model"])
        state = R.state_bytes(job["model"], job["optimizer"])
        regions = memory.region_bytes() if memory is not None else {}
        peak = memory.peak_bytes() if hasattr(memory, "peak_bytes") else 0
        if hasattr(memory, "close"):
            memory.close()                            # the regions given back while holding (torch_release)
        if place is not None and place.worker is not None:
            orchestrator.unregister_worker(pid=place.worker.pid, node=os.environ.get("TIMESLICE_NODE_NAME"))
    doc = {"job": orchestrator.job_id if orchestrator else "standalone", "standalone": a.standalone,
           "device": device, "steps": a.steps, "losses": losses, "digest": digest,
           "state_bytes": state, "wall_s": time.monotonic() - t0, "region_bytes": regions,
           "swaps": getattr(place.worker, "swaps", 0) if place else 0, "events": log.events,
           "ops": list(getattr(getattr(place, "worker", None), "ops", [])),
           "peak_bytes": peak, "host_bytes": memory.host_bytes() if memory is not None else 0,
           "residues": list(getattr(getattr(place, "worker", None), "residues", [])),
           "warnings": sorted(set(nondeterministic)), "generation": a.generation, "pin": R.pin_figures(memory),
           "dense": job["dense"].stats.to_dict() if job["dense"] is not None else None}
    if orchestrator is not None:
        orchestrator.close()
    text = json.dumps(doc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps({k: doc[k] for k in ("job", "steps", "losses", "digest", "swaps")}), flush=True)
    return 0


def cut(completion: list[int]) -> list[int]:
    """A completion up to and including its first EOS (what follows it is padding)."""
    return completion[:completion.index(R.EOS) + 1] if R.EOS in completion else completion


if __name__ == "__main__":
    raise SystemExit(main())
