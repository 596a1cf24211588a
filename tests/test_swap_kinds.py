"""One list of swap kinds (``common/swaps.py``), read by lockd, the node agent and the integrations.

A swapper forgotten in one of those places used to fail silently (a kind lockd refused, an agent
that never built its swapper, a list in the agent's report that left it out). These tests hold
every reader to the registry, and the registry to the swapper classes.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import pytest

from timeslice.common import swaps
from timeslice.common.errors import InvalidIdError
from timeslice.common.server import records as R
from timeslice.lockd.workers import WorkerRegistry
from timeslice.nodeagent import backends
from timeslice.nodeagent.backends.swapper import SwapConfigError, Swapper, swapper_class

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("client", "common", "lockd", "nodeagent", "launcher", "testing")


def _concrete_swappers() -> list[type[Swapper]]:
    for m in pkgutil.iter_modules(backends.__path__):
        if m.name not in ("cuda_driver", "cuda_cli"):         # load libcuda / look for a binary
            importlib.import_module(f"{backends.__name__}.{m.name}")
    out, todo = [], list(Swapper.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not getattr(cls, "__abstractmethods__", None) and cls.__module__.startswith("timeslice.nodeagent"):
            out.append(cls)
    return out


def test_every_kind_with_a_swapper_names_a_swapper_class_of_that_kind():
    for name in swaps.swapper_kinds():
        cls = swapper_class(name)
        assert issubclass(cls, Swapper) and cls.kind == name, (name, cls)
    for name in ("", swaps.CHECKPOINT, "no-such-kind"):
        with pytest.raises(SwapConfigError):
            swapper_class(name)


def test_every_swapper_class_of_the_agent_is_registered():
    classes = _concrete_swappers()
    assert classes, "no swapper class found"
    for cls in classes:
        assert swaps.kind_of(cls.kind) is not None, f"{cls.__name__}.kind={cls.kind!r} is not in common/swaps.py"
        assert swapper_class(cls.kind) is cls, f"common/swaps.py names another class for {cls.kind!r}"


def test_lockd_takes_exactly_the_registered_kinds_and_asks_an_endpoint_where_the_kind_needs_one():
    for name, kind in swaps.KINDS.items():
        endpoint = "http://127.0.0.1:1" if kind.endpoint else ""
        assert WorkerRegistry._swap(name, [0], endpoint, [])[0] == name
        if kind.endpoint:
            with pytest.raises(InvalidIdError, match="endpoint"):
                WorkerRegistry._swap(name, [0], "", [])
    assert WorkerRegistry._swap("", [], "", [])[0] == swaps.CHECKPOINT
    with pytest.raises(InvalidIdError, match="swap must be one of"):
        WorkerRegistry._swap("no-such-kind", [], "", [])
    assert R.WorkerValue(1, "n").swap == swaps.CHECKPOINT


def test_the_integrations_offer_the_kinds_a_job_registers_its_own_process_with():
    from timeslice.integrations.slicing import NO_SWAP, SWAPS

    assert SWAPS == (*swaps.job_kinds(), NO_SWAP) and NO_SWAP not in swaps.KINDS
    assert set(swaps.job_kinds()) == {swaps.COOPERATIVE, swaps.CHECKPOINT}


def test_the_agent_lists_the_kinds_a_swapper_moves(tmp_path):
    from timeslice.nodeagent.backends.composite import CompositeBackend
    from timeslice.nodeagent.backends.sim import SimBackend

    backend = CompositeBackend(SimBackend(tmp_path / "sim", tmp_path / "host"), lambda pid: None)
    assert backend.describe()["swappers"] == swaps.swapper_kinds()
    assert set(swaps.swapper_kinds()) == {swaps.COOPERATIVE, swaps.VLLM, swaps.SGLANG}


def test_no_product_module_spells_a_swap_kind_but_the_registry():
    """A kind's name as a string literal outside common/swaps.py is a second list in the making
    (``checkpoint`` aside: it is also the name of the checkpoint op)."""
    names = set(swaps.KINDS) - {swaps.CHECKPOINT}
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_pb2" in path.name or path == ROOT / "common" / "swaps.py":
                continue
            tree = ast.parse(path.read_text())
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                    and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            found += [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
    assert not found, "swap kinds spelled outside common/swaps.py (use its constants): " + "; ".join(found)
