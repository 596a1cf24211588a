"""Dense generation for transformers causal LMs: a static KV cache and a CUDA-graph decode step.

    gen = DenseGenerator(model, memory=memory)    # memory: a TorchMemory with a discard region "graphs"
    gen.install()                                  # model.generate is now gen.generate (TRL calls it)
    ids = model.generate(input_ids, attention_mask=mask, generation_config=cfg)

Why. ``transformers.generate`` with its dynamic cache launches every kernel of every decode
step from Python, with a host sync per step: at RL sizes the GPU waits on the CPU most of a
generation (15-20% NVML duty with the device to itself, measured). Real RL stacks generate as
vLLM and SGLang do: the cache is allocated once at its full length, and one decode step is
captured as a CUDA graph and replayed, one launch per step. This module does that for the
models the examples use (Qwen2 and its kin, full attention): the prompt is prefilled eagerly
into the static cache, then each step replays the graph (the attention mask column of the new
slot opened, the forward, the slot and positions moved on) and samples outside it.

Where its memory lives (the decision). The cache, the static inputs and every buffer the graph
captured are allocated in a *discard* region of the cooperative memory (``tag``, default
``graphs``): a swap releases them without copying anything, and the graphs need no re-capture.
That is sound because of how torch-memory-saver pauses: a region's allocations are virtual
address ranges it reserves once (``cuMemAddressReserve``) and backs with physical pages it
maps (``cuMemCreate`` + ``cuMemMap``); a pause unmaps and releases the pages and keeps the
range; a resume creates new pages and maps them at the same addresses. A captured graph holds
device pointers only, so after a resume every pointer it baked in is valid again. What the
pages held is gone (discard), and nothing needs it: every ``generate`` zeroes the cache,
rewrites the mask, the slot and the positions before its first step, and the graph's
intermediates are rewritten by every replay. Copying them out at every swap (offload) would
move bytes nobody reads; re-capturing after every resume would cost a capture per hold and
leave the graph pool outside every region, as residue the next job could not use. The graph is
captured into the region's own memory pool (``TorchMemory.graph``), so its intermediates are
in the region too; nothing else is allocated in that pool while the graph lives (a block the
graph freed could otherwise be handed to another tensor while the graph still writes it): one
shape (batch, prompt length, new tokens) is live at a time, a new one frees the last first, and
one generator uses a region. A swap never interrupts a generate: the job holds the group for the
whole of it. Mixed precision works as accelerate does it: an autocast around each ``forward``
is entered and left inside the capture, so the casts of the weights are captured and each replay
casts the weights as they are then (after the last optimizer step). Inside an autocast that
encloses generate its cache would keep casts made before the capture (freed when it ends, stale
after a step): there the step runs eagerly, and ``stats`` says why.

Determinism. The same job run alone and time-sliced runs the same kernels in the same order
(the replay is the captured sequence; sampling draws from the default generator outside the
graph, as many draws per step either way), so the bit-identity check holds. One write is
exempt from ``torch.use_deterministic_algorithms``: the cache's ``index_copy_`` of the new
slot, whose deterministic variant checks the index bounds on the host (a sync, which a capture
refuses); with one slot per step each element is written once, so the result does not depend
on order either way. Without a CUDA device (CI) the same static-cache loop runs eagerly.

Supported: sampling with temperature, top-k, top-p, or greedy; EOS (one or several) and pad as
``generate`` handles them (a finished row gets pad; the output stops at the step every row had
finished). Not: beam search, repetition penalty, min-p, sliding-window layers (refused with a
ValueError). PyTorch and transformers are imported lazily.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from timeslice.logs import get_logger

log = get_logger(__name__)
DEFAULT_TAG = "graphs"
CHECK_EVERY = 16                 # decode steps between host checks of "has every row finished?"


class _SlotCache:
    """A static KV cache shaped [batch, kv heads, max length, head dim] per layer, duck-typed to what
    transformers' attention calls (``update``); writes the prefill at [0, P) and each decode step at
    the device-side ``slot`` (one index, the same for every row: rows generate in lockstep).

    Its tensors are made at the first prefill's first layer, in the dtypes the keys and the values
    come out in (under autocast they differ: the values are the projection's, bf16; the keys pass the
    rotary embedding, float32), by ``allocate(keys, values)`` (the generator's: inside its region)."""

    def __init__(self, torch, slot, allocate: Callable[..., tuple[list, list]]):
        self._torch, self.slot, self._allocate = torch, slot, allocate
        self.keys: list = []
        self.values: list = []
        self.prefill = 0                  # > 0: the next updates write positions [0, prefill)

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        if not self.keys:
            self.keys, self.values = self._allocate(key_states, value_states)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill:
            k[:, :, :self.prefill].copy_(key_states)
            v[:, :, :self.prefill].copy_(value_states)
        else:
            with _nondeterministic_ok(self._torch):
                k.index_copy_(2, self.slot, key_states)
                v.index_copy_(2, self.slot, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0                          # positions are always given: never asked for them


@contextlib.contextmanager
def _nondeterministic_ok(torch) -> Iterator[None]:
    """Lift ``use_deterministic_algorithms`` for one write whose result is order-free (see the module doc)."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if on:
            torch.use_deterministic_algorithms(True, warn_only=warn)


@dataclass
class _Shape:
    """Everything one (batch, prompt length, new tokens) shape needs, allocated once."""

    cache: _SlotCache
    ids: Any                              # [B, 1] the token fed to the next step
    pos: Any                              # [B, 1] its position
    mask: Any                             # [B, 1, 1, L] additive attention mask of a decode step
    graph: Any = None                     # the captured decode step (CUDA), or None: run eagerly
    out: Any = None                       # the graph's logits [B, vocab] (its static output)
    first: Any = None                     # the prefill's logits of the last prompt position


@dataclass
class Stats:
    generates: int = 0
    steps: int = 0
    captures: int = 0
    capture_s: float = 0.0
    graphs: bool = False
    why_not: str = ""                     # why the decode step runs eagerly (no CUDA, a failed capture)
    region_bytes: int = 0
    shapes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class DenseGenerator:
    """Static-cache, graph-replayed ``generate`` for ``model`` (see the module doc).

    ``memory``: a cooperative memory; where it declares ``tag`` (a discard region) the cache and the
    graphs live there. ``announce(tag, tensors)``: told of the region's new tensors (default: the
    memory's ``adopt`` where it has one, e.g. the SIMULATED device's), e.g. ``ModelRegions.adopt``,
    which also tells the node agent. ``graphs``: capture the decode step (default: on CUDA)."""

    def __init__(self, model, memory=None, tag: str = DEFAULT_TAG, *, graphs: bool | None = None,
                 announce: Callable[[str, list], Any] | None = None, check_every: int = CHECK_EVERY):
        import torch
        self.torch, self.model, self.memory, self.tag = torch, model, memory, tag
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"dense generation supports full-attention layers only, this model has {sorted(kinds)}")
        self.layers = int(cfg.num_hidden_layers)
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        self.check_every = max(1, int(check_every))
        policy = getattr(memory, "tags", {}).get(tag) if memory is not None else None
        if policy is not None and policy != "discard":
            raise ValueError(f"region {tag!r} must be a discard region (its bytes are rewritten by every "
                             f"generate), not {policy!r}")
        self.in_memory = policy is not None
        self.announce = announce or (getattr(memory, "adopt", None) if self.in_memory else None)
        params = inspect.signature(type(model).forward).parameters      # the class's: accelerate may wrap the instance's
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self.stats = Stats(graphs=self.graphs, why_not="" if self.graphs else f"device {self.device.type}")
        self._original: Any = None

    def install(self) -> DenseGenerator:
        """Make ``model.generate`` this generator's (what TRL and a plain loop call)."""
        if self._original is None:
            self._original = self.model.generate
            self.model.generate = self.generate
        return self

    # -- generate ----------------------------------------------------------------------
    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        """Prompt + completion ids, [B, P + n], like ``model.generate(...)`` with sampling or greedy."""
        torch = self.torch
        gc = _settings(generation_config or self.model.generation_config, kwargs)
        if input_ids is None:
            raise ValueError("dense generate needs input_ids")
        if self.model.training and getattr(self.model, "is_gradient_checkpointing", False):
            # transformers drops the cache of a checkpointed layer in training mode (TRL turns
            # checkpointing off around its generation; do the same, or generate in eval mode)
            raise ValueError("dense generate with gradient checkpointing on in training mode: the layers "
                             "would drop the cache; disable checkpointing around generate")
        b, p = input_ids.shape
        n = int(gc["max_new_tokens"])
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if gc["copies"] > 1:                          # num_return_sequences: each prompt's rows side by side
            input_ids = input_ids.repeat_interleave(gc["copies"], 0)
            attention_mask = attention_mask.repeat_interleave(gc["copies"], 0)
        b, p = input_ids.shape
        with torch.no_grad():
            st = self._start(b, p, n, input_ids, attention_mask)
            eos = torch.tensor(gc["eos"], device=self.device) if gc["eos"] else None
            pad = gc["pad"] if gc["pad"] is not None else (gc["eos"][0] if gc["eos"] else 0)
            tokens = torch.full((b, n), pad, dtype=input_ids.dtype, device=self.device)
            alive = torch.ones(b, dtype=torch.bool, device=self.device)
            ended = torch.full((b,), n - 1, dtype=torch.long, device=self.device)
            logits = st.first
            done = 0
            for t in range(n):
                nxt = _pick(torch, logits, gc)
                nxt = torch.where(alive, nxt, torch.full_like(nxt, pad))
                tokens[:, t] = nxt
                done = t + 1
                if eos is not None:
                    stop = torch.isin(nxt, eos) & alive
                    ended = torch.where(stop, torch.full_like(ended, t), ended)
                    alive = alive & ~stop
                    if done % self.check_every == 0 and done < n and not bool(alive.any()):
                        break
                if t + 1 < n:
                    st.ids.copy_(nxt.view(b, 1))
                    logits = self._decode(st)
            last = min(done, int(ended.max()) + 1) if eos is not None else done
            self.stats.generates += 1
            self.stats.steps += done
            return torch.cat([input_ids, tokens[:, :last]], dim=1)

    # -- one shape ---------------------------------------------------------------------
    def _start(self, b: int, p: int, n: int, input_ids, attention_mask) -> _Shape:
        """The shape's buffers reset and the prompt prefilled; the first time, also allocated and
        (CUDA) the decode step captured, which runs it twice: so the prefill is made again after."""
        key = (b, p, n)
        st = self._shapes.get(key)
        fresh = st is None
        if st is None:
            self._drop()
            st = self._shapes[key] = self._allocate(b, p + n)
        self._reset(st, attention_mask, p)
        self._prefill(st, input_ids, attention_mask, p)
        if fresh and self.graphs and _enclosing_autocast(self.torch, self.device.type):
            self.graphs = self.stats.graphs = False
            self.stats.why_not = ("generate ran inside an autocast: its cache of cast weights would outlive the "
                                  "capture (autocast inside forward, as accelerate does it, is fine)")
            log.warning("dense_graphs_off", why=self.stats.why_not)
        if fresh and self.graphs:
            self._capture(st)
            self._reset(st, attention_mask, p)
            self._prefill(st, input_ids, attention_mask, p)
        return st

    def _drop(self) -> None:
        """One shape at a time: a new one frees the last (graph and buffers) before it allocates. A
        block a captured graph freed stays the graph's to write at every replay; were anything made in
        the region's pool while that graph lives, it could be handed such a block."""
        if not self._shapes:
            return
        for st in self._shapes.values():
            if st.graph is not None:
                st.graph.reset()
        self._shapes.clear()
        self.stats.region_bytes = 0
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _region(self) -> Iterator[None]:
        if self.in_memory:
            with self.memory.region(self.tag):
                yield
        else:
            yield

    def _made(self, tensors: list) -> None:
        self.stats.region_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if self.announce is not None:
            self.announce(self.tag, tensors)

    def _allocate(self, b: int, length: int) -> _Shape:
        torch = self.torch
        with self._region():
            slot = torch.zeros(1, dtype=torch.long, device=self.device)
            ids = torch.zeros((b, 1), dtype=torch.long, device=self.device)
            pos = torch.zeros((b, 1), dtype=torch.long, device=self.device)
            mask = torch.zeros((b, 1, 1, length), dtype=self._mask_dtype(), device=self.device)
        self._made([slot, ids, pos, mask])
        self.stats.shapes.append([b, length])

        def cache(k, v) -> tuple[list, list]:
            shape = lambda t: (t.shape[0], t.shape[1], length, t.shape[3])      # noqa: E731
            with self._region():
                keys = [torch.zeros(shape(k), dtype=k.dtype, device=k.device) for _ in range(self.layers)]
                values = [torch.zeros(shape(v), dtype=v.dtype, device=v.device) for _ in range(self.layers)]
            self._made([*keys, *values])
            return keys, values
        return _Shape(_SlotCache(torch, slot, cache), ids, pos, mask)

    def _mask_dtype(self):
        """The dtype transformers makes its additive masks in: the embeddings' (the model's own)."""
        return self.model.get_input_embeddings().weight.dtype

    def _reset(self, st: _Shape, attention_mask, p: int) -> None:
        """Every byte a generate reads, rewritten: the pages may be fresh ones (a discard region's)."""
        for t in (*st.cache.keys, *st.cache.values):
            t.zero_()
        st.mask.fill_(self.torch.finfo(st.mask.dtype).min)
        st.mask[:, 0, 0, :p].masked_fill_(attention_mask.bool(), 0.0)
        st.cache.slot.fill_(p)

    def _prefill(self, st: _Shape, input_ids, attention_mask, p: int) -> None:
        torch = self.torch
        length = st.mask.shape[-1]
        pos = attention_mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(attention_mask == 0, 1)
        causal = torch.ones((p, length), dtype=torch.bool, device=self.device).tril()
        keep = causal[None, None] & (st.mask == 0)                      # [B, 1, P, L]
        mask = torch.zeros(keep.shape, dtype=st.mask.dtype, device=self.device).masked_fill_(
            ~keep, torch.finfo(st.mask.dtype).min)
        st.cache.prefill = p
        try:
            out = self.model(input_ids=input_ids, attention_mask={"full_attention": mask}, position_ids=pos,
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: st.cache})
        finally:
            st.cache.prefill = 0
        st.first = out.logits[:, -1, :]
        st.pos.copy_(pos[:, -1:] + 1)

    def _step(self, st: _Shape):
        """One decode step: open the new slot's mask column, the forward, move slot and positions on."""
        st.mask.index_fill_(3, st.cache.slot, 0.0)
        out = self.model(input_ids=st.ids, attention_mask={"full_attention": st.mask}, position_ids=st.pos,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: st.cache})
        st.cache.slot.add_(1)
        st.pos.add_(1)
        return out.logits[:, -1, :]

    def _decode(self, st: _Shape):
        if st.graph is None:
            return self._step(st)
        st.graph.replay()
        return st.out

    def _capture(self, st: _Shape) -> None:
        """Warm the step up on a side stream (lazy initialisations, e.g. cuBLAS workspaces, made outside
        the region), then capture it into the region's pool. A failed capture leaves the step eager
        (slower, the same results) and says why in ``stats``."""
        torch = self.torch
        t0 = time.monotonic()
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(st)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if self.in_memory and hasattr(self.memory, "graph"):
                ctx = self.memory.graph(self.tag, graph, stream=stream)
            else:
                ctx = torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")
            with ctx:
                out = self._step(st)
            st.graph, st.out = graph, out
            self.stats.captures += 1
        except Exception as e:
            self.graphs = self.stats.graphs = False
            self.stats.why_not = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
            log.warning("dense_capture_failed", error=self.stats.why_not)
            self._check_generator(e)
        finally:
            self.stats.capture_s += time.monotonic() - t0

    def _check_generator(self, failure: BaseException) -> None:
        """A capture that failed before the stream began capturing can leave the CUDA generator in its
        capture state; every later random draw then fails with "Offset increment outside graph capture"
        (seen on the H200). Say so here, with the capture's own error, rather than at a later sample."""
        try:
            self.torch.rand(1, device=self.device)
        except Exception as e:
            raise RuntimeError(f"dense generation: a failed CUDA-graph capture ({self.stats.why_not}) left the "
                               f"CUDA generator unusable ({type(e).__name__}: {str(e)[:200]}); run with "
                               "graphs=False (the examples' --generation eager)") from failure


def _settings(gc, kwargs: dict) -> dict:
    """What generate needs of a GenerationConfig (and its keyword overrides); refuses what it cannot do."""
    get = lambda k, d=None: kwargs.get(k, getattr(gc, k, d))           # noqa: E731
    unknown = sorted(set(kwargs) - {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                                     "eos_token_id", "pad_token_id", "disable_compile", "use_cache", "num_beams",
                                     "repetition_penalty", "min_p", "num_return_sequences"})
    if unknown:
        raise TypeError(f"dense generate does not take {unknown}")
    if (get("num_beams", 1) or 1) != 1:
        raise ValueError("dense generate does not do beam search (num_beams > 1)")
    if (get("repetition_penalty", 1.0) or 1.0) != 1.0 or get("min_p") is not None:
        raise ValueError("dense generate does not apply repetition_penalty or min_p")
    if get("max_new_tokens") is None:
        raise ValueError("dense generate needs max_new_tokens")
    eos = get("eos_token_id")
    eos = [] if eos is None else [int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return {"max_new_tokens": get("max_new_tokens"), "sample": bool(get("do_sample", False)),
            "temperature": float(get("temperature", 1.0) or 1.0), "top_k": int(get("top_k", 0) or 0),
            "top_p": float(get("top_p", 1.0) or 1.0), "eos": eos, "pad": get("pad_token_id"),
            "copies": int(get("num_return_sequences", 1) or 1)}


def _pick(torch, logits, gc: dict):
    """The next token per row: argmax, or a draw as generate's sampling makes it (float32 scores,
    temperature, top-k, top-p, softmax, multinomial)."""
    scores = logits.float()
    if not gc["sample"]:
        return scores.argmax(-1)
    if gc["temperature"] != 1.0:
        scores = scores / gc["temperature"]
    if 0 < gc["top_k"] < scores.shape[-1]:
        kth = torch.topk(scores, gc["top_k"]).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if gc["top_p"] < 1.0:
        ordered, idx = torch.sort(scores, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= (1 - gc["top_p"])
        drop[..., -1:] = False                                   # keep at least one
        scores = scores.masked_fill(drop.scatter(-1, idx, drop), -float("inf"))
    return torch.multinomial(scores.softmax(-1), 1).squeeze(1)


def _enclosing_autocast(torch, device_type: str) -> bool:
    """An autocast is active around generate (not only inside each forward)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:                     # an older torch: the CUDA flag only
        return bool(torch.is_autocast_enabled())
