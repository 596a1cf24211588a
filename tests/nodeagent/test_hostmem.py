"""Admission arithmetic: free host memory and device room."""
from __future__ import annotations

from pathlib import Path

import pytest

from timeslice.common.device_errors import DeviceMemoryRefused, HostMemoryRefused
from timeslice.common.errors import ConfigError
from timeslice.nodeagent.hostmem import ENV_HOST_RESERVE, HostMemory, admit_restore, read_meminfo

PROC = Path(__file__).parent / "fixtures" / "proc"
GiB = 1 << 30


def test_meminfo_is_read_in_bytes():
    info = read_meminfo(PROC)
    assert info["MemAvailable"] == 40 * GiB
    assert info["MemTotal"] == 131891316 * 1024
    assert info["HugePages_Total"] == 0  # unit-less lines stay counts


def test_available_is_memavailable_minus_reserve():
    assert HostMemory(PROC, reserve_bytes=4 * GiB).available_bytes() == 36 * GiB
    assert HostMemory(PROC, reserve_bytes=100 * GiB).available_bytes() == 0


def test_admit_snapshot_refuses_what_does_not_fit():
    host = HostMemory(PROC, reserve_bytes=4 * GiB)
    host.admit_snapshot(36 * GiB)
    with pytest.raises(HostMemoryRefused) as exc:
        host.admit_snapshot(36 * GiB + 1)
    assert exc.value.code == "RESOURCE_EXHAUSTED"
    assert exc.value.need_bytes == 36 * GiB + 1 and exc.value.free_bytes == 36 * GiB


def test_reserve_from_environment(monkeypatch):
    monkeypatch.setenv(ENV_HOST_RESERVE, str(10 * GiB))
    assert HostMemory(PROC).available_bytes() == 30 * GiB
    monkeypatch.setenv(ENV_HOST_RESERVE, "lots")
    with pytest.raises(ConfigError):
        HostMemory(PROC)
    with pytest.raises(ConfigError):
        HostMemory(PROC, reserve_bytes=-1)


def test_admit_restore_per_device_with_headroom():
    free = {"GPU-a": 10 * GiB, "GPU-b": 2 * GiB}
    admit_restore({"GPU-a": 9 * GiB, "GPU-b": 1 * GiB}, free, headroom_bytes=GiB // 2)
    with pytest.raises(DeviceMemoryRefused, match="GPU-b"):
        admit_restore({"GPU-a": 1 * GiB, "GPU-b": 2 * GiB}, free, headroom_bytes=1)
    with pytest.raises(DeviceMemoryRefused, match="unknown"):
        admit_restore({"GPU-c": 1}, free)
    with pytest.raises(DeviceMemoryRefused, match="unknown"):
        admit_restore({"GPU-a": 1}, None)
    admit_restore({"GPU-c": 0}, None)  # nothing to put back needs no room


def test_host_being_reserved_for_pinned_backups_is_not_free():
    pending = [10 * GiB]
    host = HostMemory(PROC, reserve_bytes=4 * GiB, pending=lambda: pending[0])
    assert host.available_bytes() == 26 * GiB
    with pytest.raises(HostMemoryRefused, match="being reserved"):
        host.admit_snapshot(26 * GiB + 1)
    pending[0] = 0                                  # the reservation is done (or failed): MemAvailable tells
    host.admit_snapshot(36 * GiB)
