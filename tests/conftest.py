import os
import tempfile

pytest_plugins = ["timeslice.testing.pytest_plugin"]

# `timeslice up` remembers running local clusters in a per-user folder so that other
# commands find them from any directory; tests keep theirs in a folder of their own,
# so that neither a developer's cluster nor a parallel test session's is picked up.
os.environ.setdefault("TIMESLICE_USER_STATE_DIR", tempfile.mkdtemp(prefix="timeslice-user-state-"))

# The simulated device charges each process a context and the allocator's slack, by default the
# H200's (timeslice.common.sim.device). The suite's tests count device bytes exactly, so the charges
# are off for them; the tests of the charges and of the footprints a grant admits turn them on
# (SimDevice(context_bytes=..., slack=...)).
os.environ.setdefault("TIMESLICE_SIM_CONTEXT_BYTES", "0")
os.environ.setdefault("TIMESLICE_SIM_ALLOCATOR_SLACK", "0")
