"""A TRL GRPO job, time-sliced: ``TimeslicedGRPOTrainer`` holds the group for its GPU phases only.

    TIMESLICE_JOB_ID=job-a python examples/grpo/trl_job.py --group local    # beside `timeslice up` (elsewhere: its exports)

TRL's ``GRPOTrainer`` (generation with transformers, no vLLM) on a Qwen2-architecture
model with random weights (nothing is downloaded; see realmodel.py). The reward
function is CPU work (``--reward-s`` seconds of hashing per batch) and runs outside
the hold, so another job's GPU phase fills the gap. On a CUDA device the model and
optimizer state live in torch-memory-saver regions; without one (CI) they live in
the SIMULATED device's ``SimTorchMemory``, which overwrites them with NaN while the
job is parked, so a phase run outside its hold would change the losses.

``--standalone`` runs the same job with no lock. The job writes one JSON document
(``--out``, and its last stdout line): exact per-step losses, the final weights'
sha256, and every hold and phase span.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # before CUDA starts: deterministic cuBLAS
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import realmodel as R


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="rl-gpus")
    ap.add_argument("--standalone", action="store_true", help="no lock: the same job alone")
    ap.add_argument("--swap", choices=["cooperative", "checkpoint", "none"], default="cooperative")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto (default: %(default)s)")
    ap.add_argument("--size", default="tiny", choices=sorted(R.SIZES))
    ap.add_argument("--dtype", default="float32", help="the weights' dtype (bf16 autocast on CUDA)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=8)
    ap.add_argument("--reward-s", type=float, default=0.2, help="CPU seconds per reward call")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hint-bytes", type=int, default=0, help="device peak (default: measured)")
    ap.add_argument("--generation", choices=R.GENERATIONS, default="eager",
                    help="eager: transformers' generate (default); dense: static KV cache and a CUDA-graph decode "
                         "step (not yet proven on a GPU: benchmarks/results/gpu_round4.md)")
    ap.add_argument("--stray", action="store_true",
                    help="negative control: the reward function runs the model outside the hold")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from timeslice import OrchestratorClient
    from timeslice.integrations.slicing import TimeSlice

    nondeterministic = R.deterministic()
    device = R.pick_device(a.device)
    client = None if a.standalone else OrchestratorClient()        # job id: TIMESLICE_JOB_ID; target: as the README says
    swap = "none" if a.standalone and device == "cpu" else a.swap
    memory = arena = None
    if swap == "cooperative" and device == "cpu":
        memory = R.sim_memory()
    ts = TimeSlice(client, a.group, memory, swap=swap, device_bytes_hint=a.hint_bytes,
                   node=os.environ.get("TIMESLICE_NODE_NAME"), sync_phases=device == "cuda")
    if client is not None and swap == "cooperative":
        R.register_early(ts, a.size, a.dtype)        # the pin runs while TRL imports and the model is built
    from datasets import Dataset
    from trl import GRPOConfig

    from timeslice.integrations.trl import TimeslicedGRPOTrainer
    tok = R.tokenizer(R.SIZES[a.size][5])
    data = Dataset.from_dict({"prompt": R.prompts(a.steps * a.batch, a.prompt_len, a.seed)})
    stray = {"calls": 0, "nan": 0}

    def reward(completions, completion_ids, **_):
        R.burn_cpu(a.reward_s)                        # the CPU work: outside the hold
        out = [R.reward_of(ids) for ids in completion_ids]
        if a.stray:                                   # a user mistake: the GPU touched outside the hold
            stray["calls"] += 1
            wait_paused(ts.memory)
            with torch.no_grad():
                logit = trainer.model(torch.tensor([completion_ids[0][:4] or [R.EOS]])).logits.sum()
            stray["nan"] += int(torch.isnan(logit).item())
            out = [r + 0.0 * float(logit) for r in out]
        return out

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-job-"), per_device_train_batch_size=a.batch,
                      num_generations=a.generations, max_completion_length=a.completion_len, max_steps=a.steps,
                      learning_rate=a.lr, logging_steps=1, report_to=[], save_strategy="no", seed=a.seed,
                      use_cpu=device == "cpu", bf16=device == "cuda", disable_tqdm=True, dataloader_num_workers=0)
    R.rendezvous()
    t0 = time.monotonic()
    # The first hold builds the model on the device: ask room for what it will hold (else lockd,
    # seeing an unknown footprint, empties the device for it even where both jobs fit).
    first = R.footprint(a.size, a.dtype)
    if swap == "checkpoint" and device == "cpu":
        from timeslice.sim.torch_memory import DEFAULT_CONTEXT_BYTES
        first += DEFAULT_CONTEXT_BYTES                # SIMULATED: the arena below has a context, as a process has
    ts.expect_first(first)
    with ts.hold():                                   # the model goes onto the device inside the first hold
        region = ts.memory.region("weights") if ts.memory is not None else contextlib.nullcontext()
        with region:
            model = R.build_model(a.size, device, a.seed, a.dtype)
        if swap == "checkpoint" and device == "cpu":
            # SIMULATED: the CPU tensors are not device memory; an arena of the job's size on the
            # simulated device (its state and a context, as the cooperative jobs' SimTorchMemory
            # holds) stands for them, for the agent's checkpoint backend to move.
            from timeslice.sim.runtime import SimDeviceClient
            arena = SimDeviceClient.open(os.environ.get("TIMESLICE_SIM_DIR"))
            arena.alloc(first)
        trainer = TimeslicedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                        processing_class=tok, timeslice=ts)
        gen = R.dense(trainer.model, ts.memory, ts.regions.adopt, a.generation)
    from transformers import PrinterCallback
    trainer.remove_callback(PrinterCallback)          # the job's one output is its JSON line
    trainer.train()
    with ts.hold():                                   # the last look at the weights, while holding
        digest = R.weights_digest(trainer.model)
        state = R.state_bytes(trainer.model, trainer.optimizer)
        regions = ts.memory.region_bytes() if ts.memory is not None else {}
        peak = ts.memory.peak_bytes() if hasattr(ts.memory, "peak_bytes") else 0
        if arena is not None:
            arena.close()
        ts.finish()                                   # give the device back, withdraw the worker
    doc = {"job": client.job_id if client else "standalone", "standalone": a.standalone, "swap": swap,
           "device": device, "size": a.size, "steps": trainer.state.global_step, "losses": list(trainer.timeslice_losses),
           "digest": digest, "state_bytes": state, "wall_s": time.monotonic() - t0, "stray": stray, "events": ts.log.events,
           "region_bytes": regions,
           "host_bytes": ts.memory.host_bytes() if ts.memory is not None else 0, "peak_bytes": peak,
           "residues": list(getattr(ts.worker, "residues", [])), "warnings": sorted(set(nondeterministic)),
           "swaps": getattr(ts.worker, "swaps", 0), "ops": list(getattr(ts.worker, "ops", [])),
           "generation": a.generation,
           "dense": gen.stats.to_dict() if gen is not None else None, "pin": R.pin_figures(ts.memory)}
    if client is not None:
        m = client.measured(a.group)     # what the lock was told of this job's holds (its next Acquire's)
        doc["measured"] = {"peak": m.peak_bytes, "context": m.context_bytes}
        client.close()
    text = json.dumps(doc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps({k: doc[k] for k in ("job", "steps", "losses", "digest", "swaps", "stray")}), flush=True)
    return 0


def wait_paused(memory, timeout: float = 10.0) -> None:
    """The stray reward waits (bounded) until the agent has taken the weights away."""
    end = time.monotonic() + timeout
    while memory is not None and hasattr(memory, "is_paused") and time.monotonic() < end:
        if memory.is_paused("weights"):
            return
        time.sleep(0.01)


if __name__ == "__main__":
    raise SystemExit(main())
