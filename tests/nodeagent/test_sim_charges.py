"""The SIMULATED device charges each process what a GPU does beyond what its program asked for: a
context and the allocator's slack (timeslice.common.sim.device). The meter (the agent's NVML) sees the
whole holding, the allocator's figures only its part; a checkpoint moves all of it, as real bytes."""
from __future__ import annotations

import hashlib

import pytest
from simhelpers import MiB, Worker

from timeslice.common import device_errors as e
from timeslice.common.sim.device import DEVICE_ID, H200_CONTEXT_SHARE, SimDevice
from timeslice.memstats import measure
from timeslice.nodeagent.backends.ops import restore_processes, snapshot_processes
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.sim.runtime import SimDeviceClient
from timeslice.sim.worker import pattern

CTX = 3 * MiB
SLACK = 0.05


@pytest.fixture
def charged(sim_dir, tmp_path) -> SimBackend:
    SimDevice(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, context_bytes=CTX, slack=SLACK)
    return SimBackend(sim_dir, tmp_path / "host", capacity_bytes=64 * MiB, checkpoint_gbps=0, restore_gbps=0)


def test_a_process_holds_its_context_and_the_allocators_slack_and_a_checkpoint_moves_them(charged, sim_dir):
    w = Worker(sim_dir, 10 * MiB, 5, 1.0).ready()
    try:
        held = CTX + 10 * MiB + int(10 * MiB * SLACK)
        assert charged.device_usage(w.pid) == {DEVICE_ID: held}          # what the meter sees
        assert charged.device_free() == {DEVICE_ID: 64 * MiB - held}
        snap = snapshot_processes(charged, [w.pid], lock_timeout_ms=2000)
        assert snap.ok and snap.bytes == held, snap                     # real bytes, context and all
        assert charged.device_free() == {DEVICE_ID: 64 * MiB}
        back = restore_processes(charged, [w.pid])
        assert back.ok and charged.device_usage(w.pid) == {DEVICE_ID: held}
        assert w.ask("verify").startswith("VERIFY OK")                  # the program's bytes came back
        assert w.expected == hashlib.sha256(pattern(5, 10 * MiB)).hexdigest()
    finally:
        w.stop()


def test_the_allocators_figures_leave_the_context_out_and_an_oom_is_cudas(charged, sim_dir):
    dev = SimDeviceClient.open(sim_dir)
    try:
        dev.reset_peak()
        dev.alloc(20 * MiB)
        assert dev.allocator_bytes() == 21 * MiB == dev.allocator_peak_bytes()
        assert dev.device_used_bytes() == 21 * MiB + CTX
        m = measure(dev)
        assert (m.peak_bytes, m.context_bytes) == (21 * MiB, CTX)
        with pytest.raises(e.DeviceOutOfMemory, match="do not fit"):
            dev.hold(41 * MiB)                                          # 64 MiB: 24 + 41 do not fit
        assert dev.device_bytes == 21 * MiB + CTX                       # nothing changed
    finally:
        dev.close()


def test_the_defaults_resemble_the_h200(tmp_path, monkeypatch):
    monkeypatch.delenv("TIMESLICE_SIM_CONTEXT_BYTES", raising=False)
    monkeypatch.delenv("TIMESLICE_SIM_ALLOCATOR_SLACK", raising=False)
    dev = SimDevice(tmp_path / "s", tmp_path / "h", capacity_bytes=143_771 * MiB)
    assert dev.context_bytes == int(143_771 * MiB * H200_CONTEXT_SHARE) == 612 * MiB
    assert dev.slack == 0.02
    monkeypatch.setenv("TIMESLICE_SIM_CONTEXT_BYTES", "7")
    assert SimDevice(tmp_path / "t", tmp_path / "h", capacity_bytes=MiB).context_bytes == 7
    with pytest.raises(ValueError):
        SimDevice(tmp_path / "u", tmp_path / "h", capacity_bytes=MiB, slack=2.0)
