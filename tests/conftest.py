import os
import tempfile

pytest_plugins = ["timeslice.testing.pytest_plugin"]

# `timeslice up` remembers running local clusters in a per-user folder so that other
# commands find them from any directory; tests keep theirs in a folder of their own,
# so that neither a developer's cluster nor a parallel test session's is picked up.
os.environ.setdefault("TIMESLICE_USER_STATE_DIR", tempfile.mkdtemp(prefix="timeslice-user-state-"))
