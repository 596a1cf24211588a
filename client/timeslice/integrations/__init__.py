"""Time-slicing for real training code: PyTorch loops and RL frameworks.

* ``timeslice.integrations.pytorch`` — ``ModelRegions``: puts a ``torch.nn.Module`` and
  its optimizer (the state it creates at its first step included) into a cooperative
  memory's tagged regions, for a plain loop decorated with ``@client.on_accelerators``;
* ``timeslice.integrations.slicing`` — ``TimeSlice``: one job's holds on one group,
  its memory and its worker registration, as a framework integration drives them;
* ``timeslice.integrations.dense`` — ``DenseGenerator``: ``generate`` with a static KV cache
  and a CUDA-graph decode step (its memory in a discard region), as RL engines generate;
* ``timeslice.integrations.trl`` — ``TimeslicedGRPOTrainer`` (and its mixin): TRL's
  ``GRPOTrainer`` whose GPU phases run inside the hold and whose reward functions run
  outside it;
* ``timeslice.integrations.jax`` — ``JaxMemory``: the pytrees a JAX job names (parameters,
  optimizer state, caches) moved to host memory while it is parked, and made again before
  its next grant.

Each imports PyTorch (TRL, JAX) lazily, on first use: the lock never needs them.
"""
