"""The node agent's side of the SIMULATED GPU: its meter and its utilization counter.

The device itself is ``timeslice.common.sim`` (both ends open it); the job's side is
``timeslice.sim``; the checkpoint state machine over it is ``nodeagent/backends/sim.py``.
"""
