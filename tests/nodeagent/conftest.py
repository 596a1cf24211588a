"""Fixtures for the node agent's backend tests: a simulated device per test and
real worker processes on it."""
from __future__ import annotations

from pathlib import Path

import pytest
from simhelpers import MiB, Worker

from timeslice.nodeagent.backends.sim import SimBackend


@pytest.fixture
def sim_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "sim"
    # The CLI stand-in and the workers find the device through the environment too.
    monkeypatch.setenv("TIMESLICE_SIM_DIR", str(d))
    monkeypatch.setenv("TIMESLICE_SIM_HOST_DIR", str(tmp_path / "host"))
    monkeypatch.setenv("TIMESLICE_SIM_CHECKPOINT_GBPS", "0")
    monkeypatch.setenv("TIMESLICE_SIM_RESTORE_GBPS", "0")
    return d


@pytest.fixture
def sim(sim_dir, tmp_path) -> SimBackend:
    """A 64 MiB simulated device, copies unthrottled."""
    return SimBackend(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, checkpoint_gbps=0, restore_gbps=0)


@pytest.fixture
def spawn(sim_dir, sim):
    """spawn(nbytes, seed) -> a ready Worker; every worker is killed at teardown."""
    workers: list[Worker] = []

    def _spawn(nbytes: int = 4 * MiB, seed: int = 1, ready: bool = True, step_ms: float = 1.0) -> Worker:
        w = Worker(sim_dir, nbytes, seed, step_ms)
        workers.append(w)
        return w.ready() if ready else w

    yield _spawn
    for w in workers:
        w.stop()


@pytest.fixture
def proc_root(tmp_path) -> Path:
    """A fake /proc holding only meminfo (and whatever a test adds)."""
    root = tmp_path / "proc"
    root.mkdir()
    return root
