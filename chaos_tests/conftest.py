pytest_plugins = ["tscore.testing.pytest_plugin"]
