"""The ```python blocks of README.md (and docs/*.md) run, as written, against a live local cluster.

One cluster for the module, started the way ``timeslice up`` starts it (the launcher's
``LocalCluster``: etcd, two lockd replicas, a node agent on the SIMULATED device, its admin
token and channel socket in the run dir), with the groups the snippets name. The client's
environment points at it the way a job on that node finds it: ``TIMESLICE_TARGET``,
``TIMESLICE_NODE_NAME``, ``TIMESLICE_AGENT_SOCKET``.

A snippet that needs context gets it from an explicit ``Setup`` below, found by a line the
snippet contains: text to replace (an address that is an example), names to define (a
``generate`` stub), modules to stand in for (PyTorch, which the lock never needs and CI does
not have), and what to check once it ran. A snippet with no ``Setup`` runs as it is. Every
snippet must run: one that raises fails its test; a ``Setup`` whose marker or replaced text no
longer occurs fails too, so a README edit cannot leave a snippet unchecked by accident.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from timeslice import AsyncOrchestratorClient, OrchestratorClient
from timeslice.launcher.cluster import LocalCluster
from timeslice.launcher.procs import log_events
from timeslice.launcher.settings import Settings
from timeslice.launcher.start import create_group

ROOT = Path(__file__).resolve().parents[1]
NODE = "readme-node"
GROUPS = ("trainer-group", "sampler-group", "rl-gpus")   # the groups the snippets acquire
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Snippet:
    path: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def snippets() -> list[Snippet]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = []
    for f in files:
        text = f.read_text()
        for m in _BLOCK.finditer(text):
            out.append(Snippet(str(f.relative_to(ROOT)), text.count("\n", 0, m.start()) + 2, m.group(1)))
    return out


# -- what a snippet needs around it ------------------------------------------------------------

@dataclass
class Stack:
    cluster: LocalCluster
    admin: OrchestratorClient


@dataclass(frozen=True)
class Setup:
    marker: str                                             # a line of the snippet: which one this is for
    replace: dict[str, Callable[[Stack], str]] = field(default_factory=dict)
    names: Callable[[], dict] = dict                        # defined before it runs
    modules: Callable[[], dict[str, types.ModuleType]] = dict   # stand-ins in sys.modules while it runs
    check: Callable[[dict, Stack], None] = lambda ns, stack: None   # after it ran


def _check_api(ns: dict, stack: Stack) -> None:
    assert ns["grant"].token > 0 and ns["grant"].group_id == "trainer-group"
    job = {j.job_id: j for j in stack.admin.jobs()}["job-1"]
    assert job.workers == 1                                  # register_worker() reached lockd


class _FakeCuda:
    """The device, for a machine without a GPU: what ``TorchMemory`` reads of ``torch.cuda``.
    Allocations are made by the snippet's ``build_model`` / ``make_optimizer`` stand-ins."""

    def __init__(self) -> None:
        self.reserved, self.total = 0, 1 << 30

    def synchronize(self, device=None) -> None: ...
    def set_device(self, device) -> None: ...
    def empty_cache(self) -> None: ...

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.reserved, self.total

    def get_device_properties(self, device):
        return types.SimpleNamespace(uuid="readme-snippet-gpu")


class _FakeSaver:
    """torch-memory-saver's ``torch_memory_saver`` object: regions, pause and resume by tag."""

    def __init__(self) -> None:
        self.hook_mode, self.retain_cpu_backup = "preload", False
        self.calls: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool):
        yield

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


_torch = types.ModuleType("torch")
_torch.cuda = _FakeCuda()                                    # type: ignore[attr-defined]
_saver = types.ModuleType("torch_memory_saver")
_saver.torch_memory_saver = _FakeSaver()                     # type: ignore[attr-defined]


def _models() -> dict:
    class Model:
        def cuda(self):
            _torch.cuda.reserved += 8 << 20                  # type: ignore[attr-defined]
            return self

    def make_optimizer(model):
        _torch.cuda.reserved += 16 << 20                     # type: ignore[attr-defined]
        return object()

    return {"build_model": Model, "make_optimizer": make_optimizer}


def _check_cooperative(ns: dict, stack: Stack) -> None:
    assert ns["memory"].region_bytes() == {"weights": 8 << 20, "optimizer": 16 << 20, "kv_cache": 0}
    # cooperate(): the agent let this process in on the job's secret (its pid from the kernel) ...
    assert stack.cluster.agent is not None
    log_path = stack.cluster.agent.log_path

    def hellos() -> list:     # the agent logs the hello just after its welcome went out: wait for it
        return [ev.get("pid") for ev in log_events(log_path)
                if ev.get("event") == "channel_worker_connected" and ev.get("job") == "trainer-1"]
    deadline = time.monotonic() + 10
    while not hellos() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hellos() == [os.getpid()]
    # ... and, the stand-in saver exposing no per-region pools, the memory fell back to
    # torch-memory-saver's own backup; cooperate() ran before any region existed, so it did no
    # device work (no pause) before the first hold
    assert ns["memory"].backup == "tms"
    assert ("pause", "weights") not in _saver.torch_memory_saver.calls   # type: ignore[attr-defined]
    job = {j.job_id: j for j in stack.admin.jobs()}["trainer-1"]
    assert job.workers == 1


def _sim_memory(stack: Stack) -> str:
    """The SIMULATED device's stand-in for torch-memory-saver regions, on the cluster's simulated device."""
    return f'SimTorchMemory({{"weights": "offload", "optimizer": "offload"}}, sim_dir={stack.cluster.sim_dir!r})'


def _realmodel() -> types.ModuleType:
    sys.path.insert(0, str(ROOT / "examples" / "grpo"))
    try:
        import realmodel
    finally:
        sys.path.remove(str(ROOT / "examples" / "grpo"))
    return realmodel


def _plain_loop() -> dict:
    """Real PyTorch on the CPU: a small module, and a client for the job on the readme node."""
    torch = pytest.importorskip("torch", reason="needs the test extra (torch)")
    from timeslice.integrations.pytorch import ModelRegions
    from timeslice.sim.torch_memory import SimTorchMemory

    def build_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return {"torch": torch, "ModelRegions": ModelRegions, "SimTorchMemory": SimTorchMemory, "build_model": build_model,
            "client": OrchestratorClient(job_id="plain-1")}


def _check_plain_loop(ns: dict, stack: Stack) -> None:
    torch, place, model, opt = ns["torch"], ns["place"], ns["model"], ns["optimizer"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert place.memory.region_bytes()["weights"] == weights
    with ns["client"].on_accelerators("trainer-group"):
        model(torch.ones(2, 16)).sum().backward()
        opt.step()                                           # AdamW's state appears: in its region
    assert place.memory.region_bytes()["optimizer"] >= 2 * weights
    job = {j.job_id: j for j in stack.admin.jobs()}["plain-1"]
    assert job.workers == 1                                  # cooperate() reached lockd
    place.memory.close()


def _trl_job() -> dict:
    """A tiny random-weight Qwen2 (examples/grpo/realmodel.py), its tokenizer, prompts and a CPU reward."""
    pytest.importorskip("trl", reason="needs the test extra (trl)")
    from datasets import Dataset
    from trl import GRPOConfig

    from timeslice.sim.torch_memory import SimTorchMemory
    R = _realmodel()

    def my_reward(completions, completion_ids, **_):
        return [R.reward_of(ids) for ids in completion_ids]
    return {"model": R.build_model("tiny", "cpu", 1), "tokenizer": R.tokenizer(R.SIZES["tiny"][5]),
            "data": Dataset.from_dict({"prompt": R.prompts(4, 8, 1)}), "my_reward": my_reward,
            "GRPOConfig": GRPOConfig, "SimTorchMemory": SimTorchMemory}


_GRPO_ARGS = ('GRPOConfig(output_dir=__import__("tempfile").mkdtemp(prefix="readme-trl-"), '
              'per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1, '
              'report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)')


def _check_trl(ns: dict, stack: Stack) -> None:
    ts, trainer = ns["ts"], ns["trainer"]
    assert trainer.state.global_step == 1 and len(trainer.timeslice_losses) >= 1
    holds = [e for e in ts.log.events if e["ev"] == "hold"]
    assert len(holds) >= 2                                   # train() held, and let go for the rewards
    rewards = [e for e in ts.log.events if e["ev"] == "span" and e["name"] == "rewards"]
    assert rewards and not rewards[0]["gpu"]                 # the reward function ran outside the hold
    job = {j.job_id: j for j in stack.admin.jobs()}["grpo-a"]
    assert job.workers == 1                                  # the trainer's regions cooperate with the agent
    with ts.hold():
        ts.finish()                                          # memory back, worker withdrawn
    ts.client.close()


SETUPS = [
    Setup("orchestrator = OrchestratorClient(target=",
          replace={'"lockd-0:50051,lockd-1:50051"': lambda s: repr(s.cluster.target)},
          names=lambda: {"generate": lambda *args, **kwargs: None},
          check=_check_api),
    Setup("from timeslice.torch_memory import TorchMemory",
          names=_models, modules=lambda: {"torch": _torch, "torch_memory_saver": _saver},
          check=_check_cooperative),
    Setup("from timeslice.integrations.trl import TimeslicedGRPOTrainer",
          replace={'"rl-gpus")': lambda s: f'"rl-gpus", {_sim_memory(s)})', "GRPOConfig(...)": lambda s: _GRPO_ARGS},
          names=_trl_job, check=_check_trl),
    Setup("place = ModelRegions(TorchMemory(",
          replace={'TorchMemory({"weights": "offload", "optimizer": "offload"})': _sim_memory,
                   '"cuda")': lambda s: '"cpu")'},
          names=_plain_loop, check=_check_plain_loop),
]


def setup_of(s: Snippet) -> Setup | None:
    found = [st for st in SETUPS if st.marker in s.code]
    assert len(found) <= 1, f"{s.id}: more than one Setup matches"
    return found[0] if found else None


# -- the cluster --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run = tmp_path_factory.mktemp("readme")
    settings = Settings(etcd_members=1, lockd_replicas=2, backend="sim", sim_device_capacity_bytes=64 << 20)
    cluster = LocalCluster(settings, run / "run", node=NODE, group=None, progress=lambda _m: None,
                           sim_dir=str(run / "sim")).start()
    env = {"TIMESLICE_TARGET": cluster.target, "TIMESLICE_NODE_NAME": NODE,
           "TIMESLICE_AGENT_SOCKET": str(cluster.run_dir / "agent.sock")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            for g in GROUPS:
                create_group(cluster, g)
            with OrchestratorClient(cluster.target, job_id="readme-admin") as admin:
                yield Stack(cluster, admin)
        finally:
            cluster.stop(quiet=True)


def _close_clients(ns: dict) -> None:
    for value in ns.values():
        if isinstance(value, OrchestratorClient):
            value.close()
        elif isinstance(value, AsyncOrchestratorClient):
            raise AssertionError("an async client in a snippet: give it a Setup that runs it on a loop")


@pytest.mark.parametrize("snippet", snippets(), ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, stack: Stack):
    setup = setup_of(snippet)
    code = snippet.code
    ns: dict = {"__name__": f"snippet_{snippet.line}"}
    if setup is not None:
        for text, value in setup.replace.items():
            assert text in code, f"{snippet.id}: the Setup replaces {text!r}, which the snippet no longer has"
            code = code.replace(text, value(stack))
        ns.update(setup.names())
    with pytest.MonkeyPatch.context() as mp:
        for name, module in (setup.modules() if setup else {}).items():
            mp.setitem(sys.modules, name, module)
        try:
            exec(compile(code, snippet.id, "exec"), ns)
            if setup is not None:
                setup.check(ns, stack)
        finally:
            _close_clients(ns)


def test_every_setup_has_its_snippet():
    found = [s for s in snippets() if setup_of(s) is not None]
    for st in SETUPS:
        assert any(st.marker in s.code for s in found), f"no snippet contains {st.marker!r} any more"
