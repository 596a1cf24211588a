"""Dense generation (timeslice.integrations.dense) on the CPU: the static-cache loop the CUDA graph
replays, checked against transformers' own generate, and independent of what its memory held.

The graph capture itself needs a GPU (benchmarks/gpu_dense_probe.py checks it there: replay equal to
the eager static-cache loop, before and after a pause and resume of the graphs' region)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs the test extra (torch)")
pytest.importorskip("transformers", reason="needs the test extra (transformers)")

from timeslice.integrations.dense import DenseGenerator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "grpo"))
import realmodel as R  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = R.build_model("tiny", "cpu", seed=3)
    m.eval()
    return m


def prompts(b: int = 4, p: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 90, (b, p), generator=g)


def test_greedy_equals_transformers_generate(model):
    ids = prompts()
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          eos_token_id=None, pad_token_id=R.PAD)
    got = DenseGenerator(model).generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None,
                                         pad_token_id=R.PAD)
    assert torch.equal(got, want)


def test_greedy_with_left_padding_equals_transformers_generate(model):
    ids = prompts()
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = R.PAD, 0                 # a shorter prompt, padded on the left
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, eos_token_id=None,
                          pad_token_id=R.PAD)
    got = DenseGenerator(model).generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                                         eos_token_id=None, pad_token_id=R.PAD)
    assert torch.equal(got, want)


def test_eos_ends_rows_and_the_output_like_transformers(model):
    ids = prompts()
    free = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=R.PAD)
    eos = [int(free[0, ids.shape[1] + 2]), int(free[1, ids.shape[1] + 4])]   # rows 0 and 1 stop early
    want = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=R.PAD)
    got = DenseGenerator(model, check_every=2).generate(ids, do_sample=False, max_new_tokens=12,
                                                        eos_token_id=eos, pad_token_id=R.PAD)
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 3:] == R.PAD).all()


def test_sampling_is_deterministic_and_ignores_what_the_cache_held(model):
    """The same seed draws the same tokens; poisoning every buffer between generates (a discard region
    comes back with any bytes) changes nothing, because every generate rewrites what it reads."""
    ids = prompts(b=8)
    gen = DenseGenerator(model)

    def draw():
        torch.manual_seed(11)
        return gen.generate(ids, do_sample=True, max_new_tokens=10, top_k=20, top_p=0.9, temperature=0.8,
                            eos_token_id=None, pad_token_id=R.PAD)
    first = draw()
    (st,) = gen._shapes.values()
    for t in (*st.cache.keys, *st.cache.values, st.mask):
        t.fill_(float("nan"))
    st.pos.fill_(-7)
    st.cache.slot.fill_(3)
    assert torch.equal(draw(), first)
    torch.manual_seed(12)
    other = gen.generate(ids, do_sample=True, max_new_tokens=10, top_k=20, top_p=0.9, temperature=0.8,
                         eos_token_id=None, pad_token_id=R.PAD)
    assert not torch.equal(other, first)
    assert gen.stats.generates == 3 and gen.stats.captures == 0 and not gen.stats.graphs


def test_a_new_shape_replaces_the_last_and_the_first_comes_back_the_same(model):
    gen = DenseGenerator(model)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=R.PAD)
    a = gen.generate(prompts(b=4), max_new_tokens=6, **kw)
    b = gen.generate(prompts(b=2, p=5), max_new_tokens=9, **kw)
    assert len(gen._shapes) == 1 and b.shape == (2, 14)
    assert torch.equal(gen.generate(prompts(b=4), max_new_tokens=6, **kw), a)
    assert gen.stats.shapes == [[4, 12], [2, 14], [4, 12]]


def test_installed_generate_is_what_the_model_answers(model):
    m = R.build_model("tiny", "cpu", seed=4)
    ids = prompts()
    want = m.generate(ids, do_sample=False, max_new_tokens=5, eos_token_id=None, pad_token_id=R.PAD)
    gen = DenseGenerator(m).install()
    assert m.generate == gen.generate
    assert torch.equal(m.generate(ids, do_sample=False, max_new_tokens=5, eos_token_id=None,
                                  pad_token_id=R.PAD), want)
    assert gen.stats.generates == 1


def test_what_it_cannot_do_is_refused(model):
    gen = DenseGenerator(model)
    ids = prompts()
    with pytest.raises(ValueError, match="repetition_penalty"):
        gen.generate(ids, max_new_tokens=3, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="beam"):
        gen.generate(ids, max_new_tokens=3, num_beams=2)
    with pytest.raises(TypeError, match="output_scores"):
        gen.generate(ids, max_new_tokens=3, output_scores=True)

    class Offload:
        tags = {"graphs": "offload"}
    with pytest.raises(ValueError, match="discard"):
        DenseGenerator(model, memory=Offload())


def test_its_buffers_live_in_the_simulated_devices_discard_region(model, tmp_path):
    """On the SIMULATED device the cache and buffers are adopted into the graphs region: a pause
    poisons them (0xFF), a resume zeroes them, and the next generate is still the same."""
    from timeslice.common.sim.device import SimDevice
    from timeslice.sim.torch_memory import SimTorchMemory
    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=64 << 20)
    os.environ["TIMESLICE_SIM_HOST_DIR"] = str(tmp_path / "host")
    mem = SimTorchMemory({"weights": "offload", "graphs": "discard"}, sim_dir=tmp_path / "sim")
    try:
        gen = DenseGenerator(model, memory=mem)
        ids = prompts()
        first = gen.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=R.PAD)
        assert mem.region_bytes()["graphs"] == gen.stats.region_bytes > 0
        mem.pause(["graphs"])
        (st,) = gen._shapes.values()
        assert torch.isnan(st.cache.keys[0]).all()
        mem.resume(["graphs"])
        assert torch.equal(gen.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None,
                                        pad_token_id=R.PAD), first)
    finally:
        mem.close()
        os.environ.pop("TIMESLICE_SIM_HOST_DIR", None)


def test_a_failed_capture_leaves_the_loop_eager_with_the_same_tokens_and_says_why(model):
    """Asked for graphs where none can be captured (no CUDA here): the step runs eagerly, same output."""
    kw = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=R.PAD)
    want = DenseGenerator(model).generate(prompts(), **kw)
    gen = DenseGenerator(model, graphs=True)
    assert torch.equal(gen.generate(prompts(), **kw), want)
    assert not gen.stats.graphs and gen.stats.why_not.startswith("capture failed")


def test_inside_an_enclosing_autocast_no_graph_is_captured(model):
    """Its cache would keep casts made before the capture: the step stays eager, and stats say so."""
    gen = DenseGenerator(model, graphs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gen.generate(prompts(), do_sample=False, max_new_tokens=3, eos_token_id=None, pad_token_id=R.PAD)
    assert not gen.stats.graphs and "autocast" in gen.stats.why_not and gen.stats.captures == 0


def test_mixed_precision_as_accelerate_does_it_equals_transformers_generate():
    """An autocast around each forward (accelerate's bf16, TRL's): the values come out in bf16, the keys
    in float32 (after the rotary embedding); the cache keeps each in its own dtype, as generate's does."""
    m = R.build_model("tiny", "cpu", seed=5)
    fwd = m.forward

    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fwd(*args, **kwargs)
    m.forward = forward
    ids = prompts()
    kw = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=R.PAD)
    want = m.generate(ids, **kw)
    gen = DenseGenerator(m)
    assert torch.equal(gen.generate(ids, **kw), want)
    (st,) = gen._shapes.values()
    assert st.cache.values[0].dtype == torch.bfloat16 and st.cache.keys[0].dtype == torch.float32


def test_gradient_checkpointing_in_training_mode_is_refused_not_ignored():
    m = R.build_model("tiny", "cpu", seed=6)
    m.gradient_checkpointing_enable()
    m.train()
    with pytest.raises(ValueError, match="checkpointing"):
        DenseGenerator(m).generate(prompts(), max_new_tokens=2, eos_token_id=None, pad_token_id=R.PAD)
    m.gradient_checkpointing_disable()                   # what TRL does around its generation
    assert DenseGenerator(m).generate(prompts(), max_new_tokens=2, eos_token_id=None, pad_token_id=R.PAD).shape[1] == 8
