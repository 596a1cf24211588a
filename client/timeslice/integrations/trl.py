"""TRL's ``GRPOTrainer``, time-sliced: its GPU phases hold the group, its reward functions do not.

    from timeslice import OrchestratorClient          # or TimeSliceOrchestratorClient(target=...)
    from timeslice.integrations.slicing import TimeSlice
    from timeslice.integrations.trl import TimeslicedGRPOTrainer

    ts = TimeSlice(OrchestratorClient(job_id="job-a"), "rl-gpus")     # cooperative by default
    trainer = TimeslicedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                    train_dataset=..., processing_class=..., timeslice=ts)
    trainer.train()

Or mix ``TimesliceGRPOMixin`` in front of your own ``GRPOTrainer`` subclass. Tested with
TRL 1.16.0 (the ``trl`` extra pins ``trl>=1.16,<1.17``; another version logs a warning, and one
without the hook points below is refused at import), with transformers 5.24 (CI) and 5.17
(checked on the CPU too), PyTorch 2.13 on the CPU; one process per job, generation with
transformers (``use_vllm=False``).
Both client spellings work (``OrchestratorClient(job_id=...)``,
``TimeSliceOrchestratorClient(target=...)``: the same class).

Where the holds go. A GRPO step is generation, the old/reference log-prob
passes, the rewards, then the loss, its backward and the optimizer step. All
of it is GPU work except the rewards, so the job holds its group from the start
of ``train()`` to its end and lets go only while the reward functions run
(``_calculate_rewards``); another job's GPU phase fills that gap. The hook
points, all in TRL's ``GRPOTrainer`` or transformers' ``Trainer``:

* ``__init__``: held, and run inside the weights region, so the model (and a
  reference model, ``beta > 0``) is moved to the device inside it; the worker
  is registered at its end (cooperative: the channel and the pinned backup);
* ``create_optimizer``: the optimizer is placed (``ModelRegions.optimizer``), so
  the state AdamW creates at its first step lands in the optimizer region;
* ``train``, ``evaluate``, ``save_model``: held (re-entrant);
* ``_calculate_rewards``: released, with the trainer's accelerator pointed at
  the CPU for the call (TRL builds the reward tensor on the accelerator's
  device); the result goes to the device once the group is held again. Reward
  *models* (``nn.Module`` reward functions) need the GPU, and multi-process
  trainers gather rewards across ranks: then the rewards stay inside the hold;
* ``_generate_single_turn``, ``_generate_and_score_completions``,
  ``training_step``, ``compute_loss`` and the optimizer-step callbacks: timed
  spans and the exact per-step losses (``timeslice_losses``), for benchmarks.

What stays on the device while parked (residue; the README's table): the CUDA
context, cuBLAS workspaces, and small tensors TRL keeps between steps (the
buffered batch). Gradients do too when ``steps_per_generation`` is below
``gradient_accumulation_steps`` (a generation then falls inside an
accumulation). The KV cache of ``generate()`` is freed before the hold ends.
"""
from __future__ import annotations

import contextlib
from typing import Any

from timeslice.integrations.pytorch import expected_state_bytes, module_tensors, param_bytes
from timeslice.integrations.slicing import TimeSlice
from timeslice.logs import get_logger

log = get_logger(__name__)
TESTED_TRL = ((1, 16), (1, 17))            # [min, max) of the TRL versions this was tested with
HOOKS = ("_calculate_rewards", "_generate_single_turn", "_generate_and_score_completions", "create_optimizer",
         "training_step", "compute_loss")


class _CpuAccelerator:
    """The trainer's accelerator, seen as on the CPU: for the reward call outside the hold."""

    def __init__(self, accelerator):
        import torch
        self._acc, self.device = accelerator, torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acc, name)


class TimesliceGRPOMixin:
    """Put it before ``GRPOTrainer`` in the bases; pass ``timeslice=TimeSlice(...)`` (None: standalone)."""

    # What the trainer it is mixed into provides (annotations only: the trainer's own are found).
    model: Any
    ref_model: Any
    args: Any
    reward_funcs: Any
    accelerator: Any
    add_callback: Any
    _buffered_inputs: Any
    _step: int

    def _ts_parent(self) -> Any:
        """The trainer's own methods (the class after this mixin in the bases), untyped for mypy."""
        return super()

    def __init__(self, *args, timeslice: TimeSlice | None = None, **kwargs):
        self.timeslice = ts = timeslice if timeslice is not None else TimeSlice(None, swap="none")
        self.timeslice_losses: list[float] = []
        self._ts_warned: set[str] = set()
        with ts.hold():
            region = ts.memory.region("weights") if ts.memory is not None else contextlib.nullcontext()
            with region:
                super().__init__(*args, **kwargs)
            tensors = list(module_tensors(self.model))
            if getattr(self, "ref_model", None) is not None:
                tensors += module_tensors(self.ref_model)
            ts.regions.adopt("weights", tensors)
            # AdamW's state appears at the first step, inside train(): plan room for it (and the
            # gradients beside it) before then, or that step would not fit beside another job.
            params = list(self.model.parameters())
            ts.regions.expect("optimizer", expected_state_bytes(str(self.args.optim), params))
            ts.transient_bytes = param_bytes(params)
            self.add_callback(_optimizer_span_callback(ts))
            ts.register()

    # -- holds ---------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        with self.timeslice.hold():
            return self._ts_parent().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self.timeslice.hold():
            return self._ts_parent().evaluate(*args, **kwargs)

    def save_model(self, *args, **kwargs):
        with self.timeslice.hold():
            return self._ts_parent().save_model(*args, **kwargs)

    def create_optimizer(self, *args, **kwargs):
        opt = self._ts_parent().create_optimizer(*args, **kwargs)
        return self.timeslice.regions.optimizer(opt)

    # -- rewards, outside the hold ---------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        parent = self._ts_parent()._calculate_rewards
        why = self._rewards_need_gpu()
        if why:
            if why not in self._ts_warned:
                self._ts_warned.add(why)
                log.warning("rewards_inside_hold", reason=why)
            with self.timeslice.log.span("rewards", gpu=True):
                return parent(inputs, prompts, completions, completion_ids_list)
        accelerator = self.accelerator
        self.accelerator = _CpuAccelerator(accelerator)
        try:
            with self.timeslice.released("rewards"):
                rewards = parent(inputs, prompts, completions, completion_ids_list)
        finally:
            self.accelerator = accelerator
        return rewards.to(accelerator.device)

    def _rewards_need_gpu(self) -> str:
        import torch
        if any(isinstance(f, torch.nn.Module) for f in self.reward_funcs):
            return "a reward model runs on the GPU"
        if self.accelerator.num_processes > 1:
            return "rewards are gathered across processes on the device"
        return ""

    # -- spans and losses (for benchmarks; cheap) ----------------------------------------------
    def _generate_single_turn(self, *args, **kwargs):
        with self.timeslice.log.span("generate", gpu=True) as ev:
            completion_ids, logprobs = self._ts_parent()._generate_single_turn(*args, **kwargs)
            ev["sequences"] = len(completion_ids)
            ev["tokens"] = sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, *args, **kwargs):
        with self.timeslice.log.span("rollout", gpu=True):
            return self._ts_parent()._generate_and_score_completions(*args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        with self.timeslice.log.span("train_step", gpu=True) as ev:
            out = self._ts_parent().training_step(model, inputs, *args, **kwargs)
            ev["samples"] = _batch_rows(self._buffered_inputs, self._step)
        return out

    def compute_loss(self, *args, **kwargs):
        out = self._ts_parent().compute_loss(*args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        self.timeslice_losses.append(float(loss.detach()))
        return out


def _batch_rows(buffered, step: int) -> int:
    """Rows of the micro-batch the last training step used (TRL buffers one generation's worth)."""
    if not buffered:
        return 0
    batch = buffered[(step - 1) % len(buffered)]
    ids = batch.get("completion_ids") if isinstance(batch, dict) else None
    return int(ids.shape[0]) if ids is not None else 0


def _optimizer_span_callback(ts: TimeSlice):
    """A transformers callback timing each optimizer step as a span."""
    from transformers import TrainerCallback

    class OptimizerSpan(TrainerCallback):
        def __init__(self):
            self._span: contextlib.AbstractContextManager | None = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self._span = ts.log.span("optimizer", gpu=True, step=state.global_step)
            self._span.__enter__()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self._span is not None:
                span, self._span = self._span, None
                span.__exit__(None, None, None)

    return OptimizerSpan()


def _check_trl() -> None:
    import trl
    from trl import GRPOTrainer
    missing = [h for h in HOOKS if not hasattr(GRPOTrainer, h)]
    if missing:
        raise ImportError(f"TRL {trl.__version__}'s GRPOTrainer lacks {missing}, which the time-slicing "
                          f"integration hooks; it is tested with TRL >= 1.16, < 1.17")
    try:
        version = tuple(int(x) for x in trl.__version__.split(".")[:2])
    except ValueError:
        version = (0, 0)
    if not TESTED_TRL[0] <= version < TESTED_TRL[1]:
        log.warning("trl_version_untested", trl=trl.__version__, tested=">=1.16,<1.17")


def __getattr__(name: str) -> Any:
    """``TimeslicedGRPOTrainer``, made on first use (importing TRL only then)."""
    if name != "TimeslicedGRPOTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _check_trl()
    from trl import GRPOTrainer
    cls = type("TimeslicedGRPOTrainer", (TimesliceGRPOMixin, GRPOTrainer),
               {"__module__": __name__, "__doc__": "TRL's GRPOTrainer with TimesliceGRPOMixin: see the module doc."})
    globals()[name] = cls
    return cls
