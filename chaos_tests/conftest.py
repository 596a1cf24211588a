pytest_plugins = ["timeslice.testing.pytest_plugin"]
