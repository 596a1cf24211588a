"""A SIMULATED GPU for machines without one: real bytes in a bounded shared-memory "device".

``device`` is the node-wide device (files, capacity ledger), ``client`` what a
worker process uses instead of CUDA, ``worker`` a runnable worker for tests and
the demo. The agent side is ``nodeagent.backends.sim``.
"""
