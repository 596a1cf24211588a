import os

# The harness's fixtures; it also gives this session (each xdist worker) its own per-user state
# folder, so that neither a developer's local cluster nor another session's is picked up.
pytest_plugins = ["timeslice.testing.pytest_plugin"]

# The simulated device charges each process a context and the allocator's slack, by default the
# H200's (timeslice.common.sim.device). The suite's tests count device bytes exactly, so the charges
# are off for them; the tests of the charges and of the footprints a grant admits turn them on
# (SimDevice(context_bytes=..., slack=...)).
os.environ.setdefault("TIMESLICE_SIM_CONTEXT_BYTES", "0")
os.environ.setdefault("TIMESLICE_SIM_ALLOCATOR_SLACK", "0")
