"""What the real-model GRPO examples share: a model from a config, a tokenizer made in code, a reward.

Nothing is downloaded: the model is a Qwen2-architecture transformers model with
random weights (the kernels, memory and timings of the real thing; convergence is
judged by bit-equality with the same job run alone), and the tokenizer is a word-level
one built here, with one token per character of the prompts and filler tokens up to
the model's vocabulary size.
"""
from __future__ import annotations

import hashlib
import os
import string
import time

#: Qwen2-architecture sizes: (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
SIZES = {
    "tiny": (32, 2, 4, 2, 64, 96, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "3b": (2048, 36, 16, 2, 11008, 151936, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
}
CHARS = string.ascii_lowercase + string.digits + " .,:;!?+-*/=()"
PAD, EOS = 0, 1


def deterministic() -> list[str]:
    """Bit-reproducible kernels; returns the list that collects the warnings of operations
    that have no deterministic implementation (they run anyway: ``warn_only``, so a run is
    never lost to one; the list says whether it happened). CUBLAS_WORKSPACE_CONFIG must be set
    before CUDA starts (the scripts set it before importing torch). TRL's ``full_determinism``
    is not used: it also sets CUDA_LAUNCH_BLOCKING, which serialises every kernel launch."""
    import warnings

    import torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    seen: list[str] = []
    show = warnings.showwarning

    def record(message, category, *args, **kwargs):
        if "determinis" in str(message):
            seen.append(str(message)[:300])
        show(message, category, *args, **kwargs)
    warnings.showwarning = record
    return seen


ENV_BARRIER = "TIMESLICE_EXAMPLE_BARRIER"      # "<dir>:<n>": wait until n jobs reached it


def pick_device(choice: str) -> str:
    """cuda | cpu for ``--device`` (auto: cuda when there is one); on the CPU, one thread per job,
    as two jobs share the CI machine's cores."""
    import torch
    device = ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice
    if device == "cpu":
        torch.set_num_threads(1)
    return device


#: The cooperative regions of the examples' jobs: the model and the optimizer state (copied out at a
#: swap), the dense generator's static KV cache and CUDA graphs (released without a copy: every
#: generate rewrites what it reads; timeslice.integrations.dense says why the graphs stay valid).
TAGS = {"weights": "offload", "optimizer": "offload", "graphs": "discard"}
GENERATIONS = ("dense", "eager")


def sim_memory():
    """The SIMULATED device's memory for a job without a GPU (SimTorchMemory, on $TIMESLICE_SIM_DIR)."""
    from timeslice.sim.torch_memory import SimTorchMemory
    return SimTorchMemory(TAGS, sim_dir=os.environ.get("TIMESLICE_SIM_DIR"))


def device_bytes(doc: dict) -> int:
    """What a job document says it keeps in its regions: its state (weights, optimizer) and its dense
    generator's cache and graph buffers (a standalone run has no regions, but counts them the same)."""
    return doc["state_bytes"] + ((doc.get("dense") or {}).get("region_bytes") or 0)


def dense_bytes(size: str, rows: int, length: int, dtype: str = "float32") -> int:
    """The dense generator's static KV cache for ``rows`` sequences of ``length`` tokens (its graph's
    buffers come on top: a decode step's activations, small beside the cache at these sizes)."""
    import torch
    hidden, layers, heads, kv, _inter, _vocab, _tied = SIZES[size]
    return 2 * layers * rows * kv * length * (hidden // heads) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def dense(model, memory, announce, choice: str):
    """``--generation dense`` (opt-in; the default is ``eager``: the CUDA path failed on the H200,
    benchmarks/results/gpu_round4.md): the model generates with a static KV cache and, on CUDA, a
    CUDA-graph decode step (timeslice.integrations.dense), its memory in the ``graphs`` region;
    ``eager``: transformers' own generate. Returns the generator (None for eager)."""
    if choice == "eager":
        return None
    from timeslice.integrations.dense import DenseGenerator
    return DenseGenerator(model, memory=memory, announce=announce if memory is not None else None).install()


def rendezvous(timeout: float = 300.0) -> None:
    """Start a pair's loops together (tests and benchmarks set $TIMESLICE_EXAMPLE_BARRIER): the
    imports of one job can take longer than the whole run of the other, and then nothing is
    time-sliced. Each job leaves a file in the folder and waits until ``n`` are there."""
    raw = os.environ.get(ENV_BARRIER, "")
    if not raw:
        return
    folder, n = raw.rsplit(":", 1)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    end = time.monotonic() + timeout
    while len(os.listdir(folder)) < int(n):
        if time.monotonic() > end:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {n} jobs reached the barrier in {folder}")
        time.sleep(0.05)


def tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": PAD, "<eos>": EOS}
    for c in CHARS:
        vocab[c] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")     # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def config(size: str):
    from transformers import Qwen2Config
    hidden, layers, heads, kv, inter, vocab, tied = SIZES[size]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096,
                       tie_word_embeddings=tied, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
                       attn_implementation="eager")


def build_model(size: str, device: str, seed: int, dtype: str = "float32"):
    """Random weights from ``seed``, made directly on ``device`` (call it inside the weights region)."""
    import torch
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))       # made in its dtype: no second copy in the region
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config(size))
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def region_sizes(size: str, dtype: str = "float32") -> dict[str, int]:
    """The bytes each cooperative region of a job of this size will hold once AdamW has its state:
    weights and buffers; two moments per parameter and a step counter per tensor (from a meta-device
    model: known before the model is built, so its host backup can be pinned meanwhile)."""
    import torch
    from transformers import Qwen2ForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config(size))
    finally:
        torch.set_default_dtype(default)
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"weights": weights + buffers, "optimizer": 2 * weights + 4 * len(params)}


def footprint(size: str, dtype: str = "float32") -> int:
    """The bytes a job of this size keeps on the device once AdamW has its state (``region_sizes``)."""
    return sum(region_sizes(size, dtype).values())


def pin_figures(memory) -> dict:
    """How the job's host backup was pinned (seconds reserving, how, how long pauses waited for it) and
    what its pauses copied (``backup``: copies, bytes, clean skips)."""
    pool, book = getattr(memory, "host_pool", None), getattr(memory, "book", None)
    if pool is None or book is None:
        return {}
    return {"seconds": round(pool.seconds, 3), "bytes": pool.size(), "method": pool.method,
            "faulted_by": getattr(pool, "faulted_by", ""), "waited_s": round(book.pin_waited_s, 3),
            "windows": [list(w) for w in getattr(pool, "windows", [])],
            "backup": dict(book.stats)}                      # copies out/in, clean skips, wrong claims


def register_early(ts, size: str, dtype: str) -> None:
    """Cooperate before the first hold, the regions' sizes expected from the config: the host backup is
    pinned on a thread of its own while the job builds its model and waits for its first grant."""
    for tag, n in region_sizes(size, dtype).items():
        ts.regions.expect(tag, n)
    ts.register()


def prompts(n: int, length: int, seed: int) -> list[str]:
    import random
    rng = random.Random(seed)
    return ["".join(rng.choice(CHARS) for _ in range(length)) for _ in range(n)]


def reward_of(ids) -> float:
    """The reward of one completion from its token ids: deterministic, and varied even for random weights."""
    return sum(1.0 for t in ids if t % 3 == 0) / max(1, len(ids))


def burn_cpu(seconds: float) -> int:
    """CPU-bound work for ``seconds`` (a reward model's cost on the CPU); returns rounds done."""
    end, n, h = time.monotonic() + seconds, 0, b"reward"
    while time.monotonic() < end:
        for _ in range(2000):
            h = hashlib.sha256(h).digest()
        n += 1
    return n


def state_bytes(model, optimizer) -> int:
    """Bytes of the model's parameters and buffers and the optimizer's state (each storage once)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for st in optimizer.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def weights_digest(model) -> str:
    """A hash of every parameter's bytes, in name order (touches the device: call it inside a hold).
    xxh3-128 where xxhash is installed (a dependency of datasets; GiBs of weights in about a
    second), sha256 otherwise; the name says which."""
    import torch
    try:
        import xxhash
        h, name = xxhash.xxh3_128(), "xxh3_128"
    except ImportError:
        h, name = hashlib.sha256(), "sha256"
    for pname, p in sorted(model.named_parameters()):
        h.update(pname.encode())
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().data)
    return f"{name}:{h.hexdigest()}"
