"""Small helpers shared by the client tests."""
from __future__ import annotations

import sys
import time
import types


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class FakeCuda:
    """A stand-in for ``torch.cuda``: tells each call the client's cache release makes
    (``synchronize``, ``empty_cache``) to ``record``."""

    def __init__(self, record, initialized: bool = True):
        self.record, self.initialized = record, initialized

    def is_initialized(self):
        return self.initialized

    def synchronize(self):
        self.record("synchronize")

    def empty_cache(self):
        self.record("empty_cache")


def fake_torch(monkeypatch, cuda: FakeCuda) -> types.SimpleNamespace:
    """Make ``cuda`` the ``torch.cuda`` the client sees (a loaded torch module, for this test)."""
    torch = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch
