"""Swap kinds: how the node agent moves a registered worker's memory, and what each kind can do.

The one list: lockd checks a registration against it (``lockd/workers.py``), the node agent
builds each worker's swapper from it and names them in its report (``nodeagent/swap_routes.py``,
``nodeagent/backends/composite.py``), the integrations offer the kinds a job's own process is
moved by (``timeslice.integrations.slicing``). A new swapper is one module (a ``Swapper`` of
``nodeagent/backends/swapper.py`` whose ``kind`` is its name) and one ``register`` here: see
docs/ARCHITECTURE.md, "Add a swapper". The agent imports the class by its path; nothing here
imports server code.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapKind:
    name: str
    summary: str
    swapper: str = ""        # "module:Class" of the agent's Swapper ("": the node's checkpoint backend moves it)
    endpoint: bool = False   # registered with the server's http(s) base URL (RegisterWorker's ``endpoint``)
    regions: bool = False    # tagged regions: a selective pause, and the residue it leaves measured by the worker
    in_job: bool = False     # the job library registers a process of the job itself with it


KINDS: dict[str, SwapKind] = {}


def register(kind: SwapKind) -> str:
    """Add ``kind`` to the list; returns its name (the constant its users compare with)."""
    if kind.name in KINDS:
        raise ValueError(f"swap kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind.name


COOPERATIVE = register(SwapKind(
    "cooperative", "the job's process pauses and resumes its own tagged regions over the node-local channel",
    swapper="timeslice.nodeagent.backends.cooperative:CooperativeSwapper", regions=True, in_job=True))
CHECKPOINT = register(SwapKind(
    "checkpoint", "the node's checkpoint backend moves the whole process (CUDA checkpoint, or the simulator's)",
    in_job=True))
VLLM = register(SwapKind(
    "vllm", "a vLLM server sleeps and wakes up through its own HTTP API",
    swapper="timeslice.nodeagent.backends.app_endpoint:VllmSwapper", endpoint=True))
SGLANG = register(SwapKind(
    "sglang", "an SGLang server releases and resumes its memory through its own HTTP API",
    swapper="timeslice.nodeagent.backends.app_endpoint:SglangSwapper", endpoint=True))


def kind_of(name: str) -> SwapKind | None:
    """The kind a registration names ("" is ``checkpoint``); None for a name not on the list."""
    return KINDS.get(name or CHECKPOINT)


def swapper_kinds() -> list[str]:
    """The kinds a swapper moves (the worker moves its own memory), in registration order."""
    return [k.name for k in KINDS.values() if k.swapper]


def job_kinds() -> list[str]:
    """The kinds the job library registers its own processes with, in registration order."""
    return [k.name for k in KINDS.values() if k.in_job]
