"""The SIMULATED GPU's device, as both ends open it: real bytes in a bounded shared-memory arena.

``device`` is the node-wide device (arena, lock and state files per process) and ``ledger``
its capacity ledger. Worker processes reach it through the job library's simulated runtime
(``timeslice.sim``); the node agent checkpoints it (``nodeagent/backends/sim.py``) and meters
it (``nodeagent/sim/``). A simulator with honest semantics, never presented as a GPU.
"""
