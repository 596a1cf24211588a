# The harness's fixtures; it also gives this session (each xdist worker) its own per-user state
# folder, so that neither a developer's local cluster nor another session's is picked up.
pytest_plugins = ["timeslice.testing.pytest_plugin"]
