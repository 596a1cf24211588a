"""The ``cuda-checkpoint`` backend against a stand-in executable with the tool's command line."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from simhelpers import MiB

from timeslice.common import device_errors as e
from timeslice.common.sim.device import SimDevice
from timeslice.nodeagent.backends import pick_backend
from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.cuda_cli import CudaCliBackend
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.records import SnapshotRecords
from timeslice.nodeagent.sim.meter import SimMeter

FAKE = Path(__file__).with_name("fake_cuda_checkpoint.py")


@pytest.fixture
def tool(tmp_path) -> str:
    """An executable called cuda-checkpoint that runs the stand-in with this interpreter."""
    path = tmp_path / "bin" / "cuda-checkpoint"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def cli(tool, sim, tmp_path) -> CudaCliBackend:
    # Sizes come from the simulated device's ledger, as they would come from NVML on a GPU.
    return CudaCliBackend(tool, meter=SimMeter(sim.dev), records=SnapshotRecords(tmp_path / "state"))


def test_round_trip_through_the_tool(cli, spawn, tool, tmp_path, sim):
    w = spawn(6 * MiB, seed=3)
    assert cli.get_state(w.pid) is ProcState.RUNNING
    snap = snapshot_processes(cli, [w.pid], lock_timeout_ms=2000)
    assert snap.ok and snap.bytes == 6 * MiB, snap
    assert cli.get_state(w.pid) is ProcState.CHECKPOINTED
    assert sim.device_usage(w.pid) == {}
    # The size was recorded durably: a new backend (an agent restart) still knows it.
    again = CudaCliBackend(tool, meter=SimMeter(SimDevice()), records=SnapshotRecords(tmp_path / "state"))
    assert again.snapshot_usage(w.pid) == {"sim0": 6 * MiB}
    rest = restore_processes(again, [w.pid], headroom_bytes=0)
    assert rest.ok and rest.bytes == 6 * MiB, rest
    assert again.snapshot_usage(w.pid) is None
    assert cli.get_state(w.pid) is ProcState.RUNNING
    assert w.ask("verify") == f"VERIFY OK {w.expected}"


def test_lock_timeout_is_recognised_from_the_tools_text(cli, spawn):
    w = spawn(4 * MiB)
    w.send("hold 15000")          # long enough for a slow CLI start on a loaded machine
    assert w.read() == "HOLDING"
    with pytest.raises(e.LockTimeout) as exc:
        cli.lock(w.pid, 100)
    assert exc.value.cu_result == 600 and exc.value.cu_name == "CUDA_ERROR_NOT_READY"
    assert cli.get_state(w.pid) is ProcState.RUNNING


def test_states_of_gone_and_cudaless_processes(cli, spawn):
    assert cli.get_state(os.getpid()) is ProcState.NO_CUDA
    with pytest.raises(e.NoCudaContext):
        cli.lock(os.getpid(), 100)
    w = spawn(4 * MiB)
    w.kill()
    assert cli.get_state(w.pid) is ProcState.GONE
    with pytest.raises(e.ProcessGone):
        cli.lock(w.pid, 100)
    assert snapshot_processes(cli, [w.pid], lock_timeout_ms=100).all_gone


def test_illegal_transition_is_typed(cli, spawn):
    w = spawn(4 * MiB)
    with pytest.raises(e.IllegalState):
        cli.unlock(w.pid)  # running, not locked


def test_unknown_device_usage_refuses_the_snapshot(tool, spawn, tmp_path):
    class Blind:
        def usage(self, pid):
            return None

        def free(self):
            return None

    blind = CudaCliBackend(tool, meter=Blind(), records=SnapshotRecords(tmp_path / "s2"))
    w = spawn(4 * MiB)
    res = snapshot_processes(blind, [w.pid], lock_timeout_ms=1000)
    assert res.by_pid()[w.pid].outcome is Outcome.REFUSED and "unknown" in res.error
    assert blind.get_state(w.pid) is ProcState.RUNNING


def test_missing_tool_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TIMESLICE_CUDA_CHECKPOINT", raising=False)
    with pytest.raises(e.BackendUnavailable, match="not found"):
        CudaCliBackend()
    with pytest.raises(e.BackendUnavailable):
        pick_backend("cuda-cli")
