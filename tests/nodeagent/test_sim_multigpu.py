"""The SIMULATED device with several GPUs per node: per-GPU capacity, a worker bound to one
GPU, snapshot and restore back onto that GPU, admission per GPU (real bytes, real processes)."""
from __future__ import annotations

import pytest
from simhelpers import MiB, Worker

from timeslice.nodeagent.backends.base import ProcState
from timeslice.nodeagent.backends.ops import Outcome, restore_processes, snapshot_processes
from timeslice.nodeagent.backends.sim import SimBackend
from timeslice.nodeagent.hostmem import HostMemory
from timeslice.nodeagent.inventory import Inventory


@pytest.fixture
def sim4(sim_dir, tmp_path) -> SimBackend:
    """4 simulated GPUs of 16 MiB each, copies unthrottled."""
    return SimBackend(sim_dir, tmp_path / "host", capacity_bytes=16 * MiB, gpus=4, checkpoint_gbps=0,
                      restore_gbps=0)


@pytest.fixture
def spawn4(sim_dir, sim4):
    made: list[Worker] = []

    def _spawn(nbytes: int, gpu: int, seed: int = 1, ready: bool = True) -> Worker:
        w = Worker(sim_dir, nbytes, seed, gpu=gpu)
        made.append(w)
        return w.ready() if ready else w

    yield _spawn
    for w in made:
        w.stop()


def test_capacity_is_per_gpu_and_a_worker_holds_its_bytes_on_its_gpu(sim4, spawn4):
    full = spawn4(16 * MiB, gpu=0, seed=1)                  # GPU 0 full, GPUs 1..3 empty
    assert sim4.device_usage(full.pid) == {"sim0": 16 * MiB}
    assert sim4.device_free() == {"sim0": 0, "sim1": 16 * MiB, "sim2": 16 * MiB, "sim3": 16 * MiB}
    late = spawn4(1 * MiB, gpu=0, seed=2, ready=False)      # one more byte on GPU 0 does not fit...
    with pytest.raises(EOFError, match="do not fit on GPU 0"):
        late.read()
    small = spawn4(12 * MiB, gpu=2, seed=3)                 # ...but GPU 2 has room, whatever GPU 0 holds
    assert sim4.device_usage(small.pid) == {"sim2": 12 * MiB}
    with pytest.raises(EOFError, match="does not exist"):
        spawn4(1 * MiB, gpu=4, seed=4, ready=False).read()


def test_restore_goes_back_to_its_gpu_and_is_admitted_per_gpu(sim4, spawn4, sim_dir):
    a = spawn4(12 * MiB, gpu=1, seed=5)
    snap = snapshot_processes(sim4, [a.pid], lock_timeout_ms=2000)
    assert snap.ok and snap.bytes == 12 * MiB
    assert sim4.snapshot_usage(a.pid) == {"sim1": 12 * MiB}
    assert sim4.device_free()["sim1"] == 16 * MiB
    # Another job takes GPU 1 meanwhile: 48 MiB are free on the node, none of it where A goes.
    b = spawn4(8 * MiB, gpu=1, seed=6)
    refused = restore_processes(sim4, [a.pid], headroom_bytes=0)
    assert refused.refused and refused.by_pid()[a.pid].outcome is Outcome.REFUSED
    assert "sim1" in refused.error and sim4.get_state(a.pid) is ProcState.CHECKPOINTED
    # B leaves GPU 1: A comes back there, bytes intact.
    assert snapshot_processes(sim4, [b.pid], lock_timeout_ms=2000).ok
    back = restore_processes(sim4, [a.pid], headroom_bytes=0)
    assert back.ok and sim4.device_usage(a.pid) == {"sim1": 12 * MiB}
    assert a.ask("verify") == f"VERIFY OK {a.expected}"


def test_four_processes_of_one_job_move_in_parallel_one_per_gpu(sim4, spawn4):
    ws = [spawn4(16 * MiB if g == 0 else 2 * MiB, gpu=g, seed=10 + g) for g in range(4)]
    snap = snapshot_processes(sim4, [w.pid for w in ws], lock_timeout_ms=2000)
    assert snap.ok and snap.bytes == 22 * MiB
    assert sim4.device_free() == {f"sim{g}": 16 * MiB for g in range(4)}
    rest = restore_processes(sim4, [w.pid for w in ws], headroom_bytes=0)
    assert rest.ok and all(w.ask("verify") == f"VERIFY OK {w.expected}" for w in ws)
    assert {g: sim4.device_usage(w.pid) for g, w in enumerate(ws)} == {
        0: {"sim0": 16 * MiB}, 1: {"sim1": 2 * MiB}, 2: {"sim2": 2 * MiB}, 3: {"sim3": 2 * MiB}}


def test_inventory_lists_every_simulated_gpu(sim4, spawn4, tmp_path):
    spawn4(16 * MiB, gpu=3, seed=7)
    gpus = Inventory(sim4, HostMemory(reserve_bytes=0)).gpus()
    assert [(g["index"], g["uuid"], g["total_bytes"], g["free_bytes"]) for g in gpus] == [
        (0, "sim0", 16 * MiB, 16 * MiB), (1, "sim1", 16 * MiB, 16 * MiB), (2, "sim2", 16 * MiB, 16 * MiB),
        (3, "sim3", 16 * MiB, 0)]


def test_a_running_process_has_a_context_on_its_gpu_a_checkpointed_or_unknown_one_none(
        sim4, spawn4):
    w = spawn4(2 * MiB, gpu=2, seed=8)
    assert sim4.device_usage(w.pid) == {"sim2": 2 * MiB}
    assert snapshot_processes(sim4, [w.pid], lock_timeout_ms=2000).ok
    assert sim4.device_usage(w.pid) == {}
    assert sim4.device_usage(1) == {}                       # never registered: no context at all
