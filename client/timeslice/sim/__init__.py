"""SIMULATED device memory on the job's side, for machines without a GPU (CI, laptops, the demo).

What a job's process uses instead of CUDA: ``runtime`` (``SimDeviceClient``, allocations on
the simulated device), ``coop`` (``SimCooperativeMemory``, the stand-in for ``TorchMemory``),
``torch_memory`` (``SimTorchMemory``, tagged regions under a real PyTorch job on the CPU),
``hostpool`` (the stand-in for the pinned backup pool) and ``worker`` (a runnable simulated-GPU
worker process). The device itself is ``timeslice.common.sim``. Simulators, named as such.
"""
