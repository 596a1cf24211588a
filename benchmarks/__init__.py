"""Control-plane benchmarks of timeslice: handoff latency, scale, failover, polling baseline.

Each module is one command (``python -m benchmarks.<name>``) that prints a table
and writes ``benchmarks/results/<name>.json``; ``python -m benchmarks.run_all``
runs them all and prints the summary table. See benchmarks/README.md.
"""
