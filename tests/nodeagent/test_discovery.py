"""Finding a job's processes: registration entries and cgroup-matched NVML pids (fixture /proc)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from timeslice.common import procfs
from timeslice.nodeagent.discovery import local_registered_pids, parse_pod_uid, pod_gpu_pids, pod_uid_of

PROC = Path(__file__).parent / "fixtures" / "proc"
POD_A = "0b6c5f2e-3c1a-4c5e-9d2f-1a2b3c4d5e6f"
POD_B = "7f3e9a10-55d2-4b8e-a1c4-e2d3f4a5b6c7"
POD_C = "c41d2e7b-9a8f-4f6e-b5d4-3c2b1a0f9e8d"
STATIC = "5d41402abc4b2a76b9719d911017c592"


@pytest.mark.parametrize("pid,uid", [
    (1001, POD_A),    # v1, cgroupfs, burstable
    (1002, POD_A),    # v2, systemd, burstable (underscored uid)
    (1003, POD_B),    # v2, systemd, guaranteed
    (1004, POD_C),    # v1, systemd, besteffort, cri-o
    (1005, None),     # a login session
    (1006, STATIC),   # static pod: config hash as uid
    (1007, POD_B),    # kind: kubelet nested under its own slice
    (1008, None),     # looks like a pod, is not under kubepods
    (1009, None),     # cgroup namespace root: nothing to read
    (4242, None),     # no such pid
])
def test_pod_uid_of_fixture_processes(pid, uid):
    assert pod_uid_of(pid, PROC) == uid


def test_pod_gpu_pids_selects_one_pods_processes():
    nvml_pids = [1001, 1002, 1003, 1004, 1005, 1007, 4242]
    assert pod_gpu_pids(POD_A, nvml_pids, PROC) == [1001, 1002]
    assert pod_gpu_pids(POD_B.upper(), nvml_pids, PROC) == [1003, 1007]
    assert pod_gpu_pids(POD_C.replace("-", "_"), nvml_pids, PROC) == [1004]
    assert pod_gpu_pids("00000000-0000-0000-0000-000000000000", nvml_pids, PROC) == []


def test_parse_ignores_garbage_lines():
    assert parse_pod_uid("") is None
    assert parse_pod_uid("not a cgroup line\n\n") is None
    assert parse_pod_uid(f"0::/kubepods/burstable/pod{POD_A}x/abc") is None  # uid must end the segment


def test_registered_pids_keep_live_local_same_incarnation():
    entries = [
        {"pid": 1001, "node": "n1", "start_time": 5000},  # alive, same incarnation
        {"pid": 1002, "node": "n1"},                      # alive, no start time recorded
        {"pid": 1003, "node": "n2"},                      # another node
        {"pid": 2001, "node": "n1"},                      # zombie: exited
        {"pid": 2002, "node": "n1", "start_time": 6999},  # pid reused by another process
        {"pid": 4242, "node": "n1"},                      # gone
        {"pid": "junk", "node": "n1"},                    # malformed
        {"node": "n1"},
    ]
    assert local_registered_pids(entries, "n1", PROC) == [1001, 1002]
    assert local_registered_pids(entries, "n2", PROC) == [1003]


def test_start_time_parses_odd_command_names():
    assert procfs.start_time(1003, PROC) == 5200   # "(vllm (worker) 0)"
    assert procfs.start_time(2001, PROC) is None    # zombie
    assert procfs.start_time(os.getpid()) is not None  # the real /proc
