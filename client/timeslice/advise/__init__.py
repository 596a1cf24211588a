"""Advice: job profiles, the scheduler's simulation, and which jobs should share GPUs (sans-IO).

``profile`` (what lockd records, and the file format), ``simulate`` (the one
model of the scheduler: FIFO turns, swap costs, elision; and the definition of
GPU busy time the demo and benchmarks measure with), ``grouping`` (the
advisor behind ``timeslice advise``).
"""
