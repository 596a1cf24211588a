"""``timeslice demo``: two synthetic RL jobs, without sharing and then time-sliced.

``job`` is one job's process (the RL loop with ``@on_accelerators``),
``devices`` its GPU work (simulated device or PyTorch), ``runner`` drives the
runs, ``analysis`` computes duty cycle, swaps and overlaps from the jobs'
event files, ``timeline`` draws the picture.
"""
