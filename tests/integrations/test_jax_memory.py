"""The cooperative JAX memory in one process (no etcd needed): SimJaxMemory, the SIMULATED device's stand-in
for JaxMemory, on JAX's CPU backend. A pause really deletes the arrays and takes their bytes off the device,
a resume makes them again bit for bit (verified), an unchanged tree is not copied twice, what lies outside
the regions is reported, and the cooperative worker's pause answers with it. JAX is imported once here."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax = pytest.importorskip("jax", reason="needs the test extra (jax[cpu])")
jnp = jax.numpy

from timeslice.backup import BackupCorrupted, BackupError  # noqa: E402
from timeslice.common.device_errors import DeviceOutOfMemory  # noqa: E402
from timeslice.common.sim.device import SimDevice  # noqa: E402
from timeslice.cooperative import CooperativeWorker  # noqa: E402
from timeslice.integrations.jax import JaxMemory, RegionReleased, nbytes_of  # noqa: E402
from timeslice.sim.jax_memory import SimJaxMemory  # noqa: E402

CTX = 4096
TAGS = {"params": "offload", "opt_state": "offload", "cache": "discard"}


@pytest.fixture
def sim(tmp_path):
    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=1 << 20)
    return tmp_path / "sim"


@pytest.fixture
def mem(sim):
    for a in jax.live_arrays():                              # the process's arrays are one pool: start from none
        a.delete()
    m = SimJaxMemory(TAGS, sim_dir=sim, context_bytes=CTX, gbps=0)
    yield m
    m.close()


def params(seed: int = 0) -> dict:
    k = jax.random.key(seed)
    return {"w": jax.random.normal(k, (8, 16)), "b": jnp.arange(16, dtype=jnp.bfloat16),
            "step": 3, "mask": jnp.array([True, False, True]), "ids": jnp.arange(5, dtype=jnp.int32)}


def raw(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() if isinstance(x, jax.Array) else repr(x).encode()
            for x in jax.tree_util.tree_leaves(tree)]


def nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array))


def test_pause_deletes_every_array_and_resume_makes_them_again_bit_exact(mem):
    before = raw(params())                                   # (NumPy views of some dtypes keep a copy alive on the CPU)
    p = params()
    n = nbytes(p)
    mem["params"] = p
    assert mem.region_bytes() == {"params": n, "opt_state": 0, "cache": 0}
    assert mem.dev.device_bytes == CTX + n                   # the simulated device counts the region
    assert mem.pause(["params"]) == n
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(p) if isinstance(x, jax.Array))
    with pytest.raises(RuntimeError, match="deleted"):
        p["w"] + 1                                           # a reference kept from before the pause
    with pytest.raises(RegionReleased):
        mem["params"]                                        # a read outside the hold
    with pytest.raises(RegionReleased):
        mem["params"] = params(1)
    assert mem.dev.device_bytes == CTX and mem.residue_bytes() == CTX
    assert mem.host_bytes() >= n                             # the retained backup
    assert mem.resume(["params"]) == n
    q = mem["params"]
    assert raw(q) == before and q["step"] == 3 and q["b"].dtype == jnp.bfloat16
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(p)
    assert mem.dev.device_bytes == CTX + n and mem.backup_stats()["verified"] == 1


def test_an_unchanged_tree_is_not_copied_again_and_a_new_one_is(mem):
    mem["params"] = params()
    mem.prepin()
    assert mem.pause(["params"]) > 0
    mem.resume(["params"])
    for _ in range(2):                                       # the same arrays since the copy: no copy out
        assert mem.pause(["params"]) == 0
        mem.resume(["params"])
    mem["params"] = mem["params"]                            # putting the same arrays back changes nothing
    assert mem.pause(["params"]) == 0
    mem.resume(["params"])
    new = jax.tree_util.tree_map(lambda x: x * 2 if isinstance(x, jax.Array) and x.dtype != bool else x,
                                 mem["params"])
    want = raw(new)
    mem["params"] = new
    assert mem.pause(["params"]) == nbytes(new)              # a new tree: copied
    mem.resume(["params"])
    assert raw(mem["params"]) == want
    s = mem.backup_stats()
    assert (s["copies_out"], s["clean_skips"], s["clean_mismatches"], s["pool_grown"]) == (2, 3, 0, 0)


def test_bytes_changed_under_an_unchanged_tree_are_caught_both_ways(mem):
    mem["params"] = {"w": jnp.arange(64, dtype=jnp.float32)}
    mem.pause(["params"])
    mem.resume(["params"])
    w = mem["params"]["w"]
    ctypes.memset(w.unsafe_buffer_pointer(), 0x7F, 8)        # written behind JAX's back (an aliasing DLPack view)
    want = np.asarray(w).tobytes()
    assert mem.pause(["params"]) == 256                      # the clean check saw it: copied after all
    assert mem.backup_stats()["clean_mismatches"] == 1
    mem.resume(["params"])
    assert np.asarray(mem["params"]["w"]).tobytes() == want
    mem.pause(["params"])
    mem.host_pool.slabs[0][0] ^= 0xFF                        # the host copy corrupted while paused
    with pytest.raises(BackupCorrupted):
        mem.resume(["params"])
    assert mem.is_paused("params") and mem.dev.device_bytes == CTX   # nothing half-made stays on the device


def test_a_discard_region_comes_back_zeroed_and_is_never_copied(mem):
    mem["cache"] = {"k": jnp.ones((4, 4)), "v": jnp.full((2,), 7, jnp.int32)}
    assert mem.pause(["cache"]) == 0 and mem.host_bytes() == 0
    mem.resume(["cache"])
    c = mem["cache"]
    assert not np.asarray(c["k"]).any() and not np.asarray(c["v"]).any() and c["v"].dtype == jnp.int32


def test_resume_reserves_room_first(mem, sim):
    p = params()
    mem["params"] = p
    mem.pause(["params"])
    SimDevice(sim, capacity_bytes=CTX + 16)                  # another job's turn: no room now
    with pytest.raises(DeviceOutOfMemory):
        mem.resume(["params"])
    assert mem.is_paused("params") and mem.dev.device_bytes == CTX
    SimDevice(sim, capacity_bytes=1 << 20)
    mem.resume(["params"])
    assert not mem.is_paused("params") and mem.dev.device_bytes == CTX + nbytes(p)


def test_arrays_outside_the_regions_are_reported_at_the_first_pause(mem):
    mem["params"] = params()
    stray = [jnp.zeros((100,)), jnp.ones((10, 10), jnp.int32)]
    mem.pause(["params", "opt_state"])
    got = mem.left_behind
    assert got["arrays"] == 2 and got["bytes"] == 800
    assert {"shape": [100], "dtype": "float32", "bytes": 400} in got["largest"]
    assert mem.residue_bytes() == CTX == mem.dev.device_bytes   # (booked: the context; they are what a GPU keeps)
    del stray
    mem.resume(["params", "opt_state"])
    mem.pause(["params"])
    assert mem.left_behind == got                            # told once, at the first pause


def test_sizes_declared_before_the_arrays_exist_are_pinned_up_front(mem):
    shapes = jax.eval_shape(lambda: params())
    mem.declare("params", shapes)
    mem.declare("opt_state", 4096)
    mem.prepin()                                             # no array yet: what cooperate does before the first hold
    assert mem.host_bytes() == nbytes_of(jax, shapes) + 4096 >= nbytes(params()) + 4096   # ("step": 3 counts too)
    assert mem.region_bytes()["params"] == 0
    mem["params"] = params()
    mem.pause(["params"])
    assert mem.backup_stats()["pool_grown"] == 0 and mem.host_bytes() == nbytes_of(jax, shapes) + 4096
    with pytest.raises(ValueError):
        mem.declare("cache", 10)                             # discard regions have no backup


def test_what_a_region_cannot_hold_is_refused(mem):
    p = params()
    mem["params"] = p
    with pytest.raises(ValueError, match="another region"):
        mem["opt_state"] = {"w": p["w"]}
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(ValueError, match="deleted"):
        mem["opt_state"] = [gone]
    p["w"].delete()                                          # donated to a jitted call and not put back
    with pytest.raises(BackupError, match="deleted outside the memory"):
        mem.pause(["params"])
    with pytest.raises(ValueError, match="unknown tag"):
        mem["nope"] = 1


def test_the_cooperative_worker_pauses_by_tag_and_reports_the_residue(mem):
    mem["params"] = params()
    mem["opt_state"] = {"m": jnp.zeros((8, 16))}
    keep = jnp.ones((50,))                                   # outside the regions
    w = CooperativeWorker("job-a", "secret", mem, "node", socket_path="/nonexistent")
    done = w.handle({"type": "pause", "id": 1, "tags": None})
    assert done["ok"] and done["tags"] == ["params", "opt_state", "cache"]
    assert done["bytes_moved"] == nbytes(params()) + 512 and done["state"] == "paused"
    assert done["residue_bytes"] == CTX == w.residue_bytes
    assert mem.left_behind["bytes"] == 200
    done = w.handle({"type": "resume", "id": 2})
    assert done["ok"] and done["state"] == "running" and not mem.is_paused("opt_state")
    assert raw(mem["opt_state"]) == [np.zeros((8, 16), np.float32).tobytes()]
    del keep


def test_a_failed_pause_gives_back_what_it_released(mem, sim):
    mem["params"] = params()
    mem["opt_state"] = [jnp.ones(4)]
    mem["opt_state"][0].delete()                              # the second tag cannot be paused
    w = CooperativeWorker("job-a", "secret", mem, "node", socket_path="/nonexistent")
    done = w.handle({"type": "pause", "id": 1, "tags": ["params", "opt_state"]})
    assert not done["ok"] and "deleted outside the memory" in done["error"]
    assert not mem.is_paused("params") and w.paused == []     # all or nothing
    assert raw(mem["params"]) == raw(params())


def test_the_allocator_that_returns_freed_memory_is_set_before_jax_starts_and_only_then():
    code = """if True:
        import os, jax
        from timeslice.integrations.jax import returning_allocator as r
        names = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
        early = r(); print(early, [os.environ.get(k) for k in names])
        jax.devices()                                    # the backends start
        for k in names: del os.environ[k]
        late = r(); print(late, [os.environ.get(k) for k in names])
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["True ['false', 'platform']",
                                       "False [None, None]"], out.stderr[-2000:]   # too late: nothing changed


def test_the_real_memory_on_the_cpu_uses_the_host_backup():
    m = JaxMemory({"w": "offload"}, allocator=None)
    assert m.backup == "host" and m.device_id() == ""
    m["w"] = [jnp.arange(10.0)]
    m.pause(["w"])
    m.resume(["w"])
    assert np.asarray(m["w"][0]).tolist() == list(range(10))
    with pytest.raises(BackupError):
        JaxMemory({"w": "offload"}, backup="pool", allocator=None)
    m.close()


def test_it_says_what_the_footprint_of_a_hold_was(mem):
    mem.reset_peak()
    mem["params"] = params()
    n = nbytes(params())
    assert mem.allocator_bytes() == n and mem.device_used_bytes() == CTX + n
    mem.pause(["params"])
    assert mem.allocator_bytes() == 0 and mem.allocator_peak_bytes() == n   # the peak of the hold stays
    mem.reset_peak()
    assert mem.allocator_peak_bytes() == 0


def test_the_host_backup_is_admitted_before_it_is_made(sim):
    m = JaxMemory({"w": "offload"}, allocator=None)
    asked: list[int] = []

    def refuse(n: int) -> None:
        asked.append(n)
        raise MemoryError("the node's host memory cannot take it")
    m.set_host_admission(refuse)
    m.declare("w", 1 << 20)
    with pytest.raises(MemoryError):
        m.prepin()
    assert asked == [1 << 20] and m.host_bytes() == 0       # refused: nothing taken
    m.set_host_admission(asked.append)
    m.prepin()
    assert asked[-1] == 1 << 20 and m.host_bytes() == 1 << 20
    m.close()


def test_a_jax_memory_registers_a_worker_the_driver_checkpoint_never_takes(mem):
    """On the H200 a JAX process died of SIGSEGV after every cuda-checkpoint of it: its cooperative worker
    registers as one whose context is never checkpointed (``collective``: lockd moves no residue of it by
    checkpoint), a torch memory does not."""
    from timeslice.sim.torch_memory import SimTorchMemory
    from timeslice.workers import never_checkpoint
    assert never_checkpoint(mem)
    assert not never_checkpoint(SimTorchMemory.__new__(SimTorchMemory))
