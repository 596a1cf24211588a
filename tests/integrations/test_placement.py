"""The job-side pieces of the real-framework integrations, in one process (no etcd needed):
the SIMULATED CPU memory's pause really takes tensors away, ModelRegions puts an optimizer's
lazily created state into its region, and TimeSlice's holds and hint behave."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs the test extra (torch)")

from timeslice.common.device_errors import DeviceOutOfMemory, IllegalState  # noqa: E402
from timeslice.common.sim.device import SimDevice  # noqa: E402
from timeslice.integrations.pytorch import ModelRegions, expected_state_bytes, needs_state  # noqa: E402
from timeslice.integrations.slicing import TimeSlice  # noqa: E402
from timeslice.sim.torch_memory import SimTorchMemory  # noqa: E402

CTX = 4096


@pytest.fixture
def sim(tmp_path):
    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=1 << 20)
    return tmp_path / "sim"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    m.register_buffer("counts", torch.arange(5))          # an integer buffer too
    return m


def raw(m: torch.nn.Module) -> list[bytes]:
    return [t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()
            for t in [*m.parameters(), *m.buffers()]]


def test_pause_poisons_every_adopted_byte_and_resume_brings_them_back_bit_exact(sim):
    mem = SimTorchMemory(sim_dir=sim, context_bytes=CTX)
    m = model()
    before = raw(m)
    n = sum(t.untyped_storage().nbytes() for t in [*m.parameters(), *m.buffers()])
    assert ModelRegions(mem).module(m) is m
    assert mem.region_bytes() == {"weights": n, "optimizer": 0}
    assert mem.dev.device_bytes == CTX + n                  # the simulated device counts the region
    mem.pause(["weights"])
    assert all(torch.isnan(p).all() for p in m.parameters())
    assert (m.counts == -1).all()                           # integers: every byte 0xFF
    assert torch.isnan(m(torch.ones(1, 8))).all()           # a phase run now computes with NaN
    assert mem.dev.device_bytes == CTX and mem.residue_bytes() == CTX
    assert mem.host_bytes() == n                            # the retained backup
    mem.resume(["weights"])
    assert raw(m) == before and mem.dev.device_bytes == CTX + n
    mem.close()


def test_resume_reserves_room_first_and_a_released_region_cannot_adopt(sim, tmp_path):
    mem = SimTorchMemory(sim_dir=sim, context_bytes=CTX)
    m = model()
    ModelRegions(mem).module(m)
    mem.pause(["weights"])
    with pytest.raises(IllegalState):
        mem.adopt("weights", [torch.zeros(4)])
    SimDevice(sim, capacity_bytes=CTX + 16)                # someone else's turn: no room now
    with pytest.raises(DeviceOutOfMemory):
        mem.resume(["weights"])
    assert mem.is_paused("weights") and torch.isnan(next(m.parameters())).all()
    SimDevice(sim, capacity_bytes=1 << 20)
    mem.resume(["weights"])
    assert not mem.is_paused("weights") and not torch.isnan(next(m.parameters())).any()
    mem.close()


def test_a_discard_region_comes_back_zeroed(sim):
    mem = SimTorchMemory({"weights": "offload", "kv": "discard"}, sim_dir=sim, context_bytes=CTX)
    kv = torch.ones(32)
    mem.adopt("kv", [kv])
    mem.pause(["kv"])
    assert torch.isnan(kv).all() and mem.host_bytes() == 0
    mem.resume(["kv"])
    assert (kv == 0).all()
    mem.close()


def test_the_optimizer_state_made_at_the_first_step_lands_in_its_region(sim):
    mem = SimTorchMemory(sim_dir=sim, context_bytes=CTX)
    place = ModelRegions(mem)
    m = place.module(model())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    place.optimizer(opt)
    assert place.expected == {"optimizer": 2 * weights}    # two moments, planned before they exist
    assert place.missing_bytes() == 2 * weights
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))   # wraps step through __func__
    m(torch.ones(2, 8)).sum().backward()
    assert needs_state(opt)
    opt.step()
    sched.step()
    state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values())
    assert mem.region_bytes()["optimizer"] == state and state >= 2 * weights
    assert place.missing_bytes() == 0 and not needs_state(opt)
    mem.pause(["optimizer"])
    assert all(torch.isnan(v).all() for st in opt.state.values() for v in st.values())
    mem.resume(["optimizer"])
    opt.step()                                             # later steps create nothing new
    assert mem.region_bytes()["optimizer"] == state
    mem.close()


def test_a_loaded_optimizer_state_is_adopted_too(sim):
    mem = SimTorchMemory(sim_dir=sim, context_bytes=CTX)
    place = ModelRegions(mem)
    m = place.module(model())
    first = torch.optim.Adam(m.parameters())
    m(torch.ones(2, 8)).sum().backward()
    first.step()
    second = place.optimizer(torch.optim.Adam(m.parameters()))
    second.load_state_dict(first.state_dict())
    assert mem.region_bytes()["optimizer"] > 0
    mem.close()


def test_expected_state_by_optimizer_kind():
    p = [torch.nn.Parameter(torch.zeros(10)), torch.zeros(3)]          # the plain tensor is not trainable
    assert expected_state_bytes("adamw_torch_fused", p) == 80
    assert expected_state_bytes("SGD", p) == 40
    assert expected_state_bytes("Adafactor", p) == 0
    assert expected_state_bytes("SomethingNew", p) == 80               # unknown: assumed Adam-like


def test_standalone_holds_nest_and_released_logs_a_cpu_span():
    ts = TimeSlice(None, swap="none")
    with ts.hold() as g:
        assert g is None and ts.held
        with ts.hold():
            with ts.released("rewards"):
                assert not ts.held
            assert ts.held
    assert not ts.held
    kinds = [(e["ev"], e.get("name")) for e in ts.log.events]
    assert kinds == [("hold", None), ("span", "rewards"), ("hold", None)]
    assert ts.log.events[1]["gpu"] is False


def test_the_hint_plans_for_optimizer_state_not_made_yet(sim):
    mem = SimTorchMemory(sim_dir=sim, context_bytes=CTX)
    ts = TimeSlice(None, memory=mem, device_bytes_hint=10)
    m = ts.regions.module(model())
    opt = ts.regions.optimizer(torch.optim.AdamW(m.parameters()))
    ts.transient_bytes = 7
    ts.register()                                           # standalone: nothing to tell, but it counts
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    assert ts._hint() == mem.peak_bytes() + 2 * weights + 7
    with ts.hold():
        pass
    assert ts._next_hint == mem.peak_bytes() + 2 * weights + 7   # worked out at the release, while held
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert ts._hint() == mem.peak_bytes()                   # measured now: no estimate on top
    with pytest.raises(ValueError):
        TimeSlice(None, swap="sometimes")
    mem.close()


def test_a_cpu_span_never_touches_the_device(monkeypatch):
    """A span outside the hold (the rewards) must not synchronize: the parked process may be
    checkpointed, and a CUDA call there blocks until the next grant, which it would never ask for."""
    import timeslice.integrations.slicing as S
    from timeslice.integrations.slicing import PhaseLog
    calls = []
    monkeypatch.setattr(S, "_cuda_ready", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    log = PhaseLog(sync=True)
    with log.span("rewards", gpu=False):
        pass
    assert calls == []
    with log.span("generate", gpu=True):
        pass
    assert calls == ["sync"]


class _Declaring:
    """A memory that sizes its host backup ahead, as TorchMemory.declare does (records the calls)."""
    tags = {"weights": "offload", "optimizer": "offload", "kv": "discard"}

    def __init__(self):
        self.declared: list[tuple[str, int]] = []

    def declare(self, tag, nbytes):
        self.declared.append((tag, nbytes))

    def region_bytes(self):
        return {}


def test_an_expected_optimizer_state_sizes_the_host_backup_before_the_first_step():
    # Without it the first step's hold pinned 12.5 GB (2.7 s) on the H200 (TRL run, round 3).
    mem = _Declaring()
    place = ModelRegions(mem)
    m = torch.nn.Linear(8, 8)
    place.optimizer(torch.optim.AdamW(m.parameters()))
    want = expected_state_bytes("AdamW", list(m.parameters()))
    assert mem.declared == [("optimizer", want)]
    place.expect("kv", 1 << 20)                    # a discard region has no backup to size
    assert mem.declared == [("optimizer", want)]


def test_the_old_name_the_readme_documents_still_imports():
    from timeslice.integrations.pytorch import Placement
    assert Placement is ModelRegions


class _Promising:
    """A memory that keeps clean promises (as TorchMemory's pool backup does): records them in order."""
    tags = {"weights": "offload", "optimizer": "offload"}

    def __init__(self):
        self.calls: list[str] = []

    def region(self, tag):
        import contextlib
        return contextlib.nullcontext()

    def region_bytes(self):
        return {}

    def mark_clean(self, tag):
        self.calls.append(f"clean {tag}")

    def mark_dirty(self, tag):
        self.calls.append(f"dirty {tag}")

    def writing(self, tag):
        import contextlib

        @contextlib.contextmanager
        def w():
            self.mark_dirty(tag)
            yield
            self.mark_clean(tag)
        return w()


def test_clean_between_steps_promises_both_regions_unchanged_except_inside_a_step():
    """Only an optimizer step writes the weights and its state: between steps a pause (after a
    generation) need not copy them out again. A step that fails leaves both dirty."""
    mem = _Promising()
    place = ModelRegions(mem, clean_between_steps=True)
    m = place.module(torch.nn.Linear(4, 4))
    assert mem.calls == ["clean weights"]
    opt = place.optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    real = opt.step.__func__ if hasattr(opt.step, "__func__") else None
    assert real is not None
    m(torch.ones(1, 4)).sum().backward()
    mem.calls.clear()
    opt.step()
    assert mem.calls == ["dirty weights", "dirty optimizer", "clean optimizer", "clean weights"]
    mem.calls.clear()
    opt.zero_grad()
    assert mem.calls == []                                 # only a step writes them
    bad = torch.optim.SGD(m.parameters(), lr=0.1)
    bad.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a failed step"))   # type: ignore[method-assign]
    place.optimizer(bad)
    with pytest.raises(RuntimeError):
        bad.step()
    assert mem.calls == ["dirty weights", "dirty optimizer"]
    assert ModelRegions(_Promising()).clean is False        # off by default
