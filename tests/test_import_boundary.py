"""Import boundaries: what an RL job imports stays lean, and product code never imports the test harness.

The job client (``timeslice``, i.e. client/timeslice/, its cooperative side included) must not pull in
lockd, the node agent, the local launcher and its demo (``timeslice.launcher``, server-side), the etcd
client (aetcd), the test harness, or PyTorch (imported lazily by TorchMemory only).
Checked in a fresh interpreter, so nothing imported by the test session itself hides a leak.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN = ("timeslice.lockd", "timeslice.nodeagent", "timeslice.launcher", "aetcd", "timeslice.testing",
             "timeslice.common.server", "torch", "torch_memory_saver", "prometheus_client", "pynvml")
#: The top-level names the packages had before they moved under one namespace, and the
#: folders' own names (the repository root on sys.path would make `import common` work by accident).
OLD_NAMES = ("lockd", "nodeagent", "tscore", "tsproto", "common", "testing", "launcher", "proto")

PROBE = """
import sys

import pytest
import timeslice, timeslice.cooperative, timeslice.common.channel, timeslice.torch_memory, timeslice.cli, timeslice.cli_admin
import timeslice.backup, timeslice.pinned, timeslice.torch_regions
import timeslice.sim.runtime, timeslice.sim.coop, timeslice.sim.torch_memory, timeslice.sim.hostpool
import timeslice.cli_advise, timeslice.cli_slurm, timeslice.common.cliout
from timeslice import OrchestratorClient, AsyncOrchestratorClient, TimeSliceOrchestratorClient
bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in sys.argv[1:]))
print(",".join(bad))
"""


def test_the_job_client_imports_nothing_server_side():
    out = subprocess.run([sys.executable, "-c", PROBE, *FORBIDDEN], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the job client imported: {out.stdout.strip()}"


TRACING_OFF = """
import os, sys
os.environ.pop("TIMESLICE_TRACING", None)
import timeslice, timeslice.holds
from timeslice.common import tracing
with tracing.span("timeslice.acquire", kind="client", attributes={"timeslice.job": "j"}) as s:
    assert s is None and tracing.metadata() is None and tracing.traceparent() == ""
assert tracing.record("x", start_ns=1, end_ns=2) == "" and not tracing.enabled()
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")))
"""


def test_traces_off_import_no_opentelemetry():
    """Traces are opt-in: with TIMESLICE_TRACING unset the client's span helpers are no-ops that
    never import opentelemetry (installed or not)."""
    out = subprocess.run([sys.executable, "-c", TRACING_OFF], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported with traces off: {out.stdout.strip()}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_product_code_never_imports_the_test_harness():
    product = [p for d in ("lockd", "nodeagent", "client", "common", "launcher", "proto")
               for p in (ROOT / d).rglob("*.py")]
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("timeslice.testing"))
                 for p in product}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_nothing_imports_the_old_top_level_names():
    """Everything lives under ``timeslice``; an import of ``lockd`` (say) would only work by accident."""
    files = [p for d in ("lockd", "nodeagent", "client", "common", "testing", "launcher", "proto", "tests",
                         "chaos_tests", "benchmarks", "examples", "scripts") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 100
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] in OLD_NAMES)
                 for p in files}
    assert {p: n for p, n in offenders.items() if n} == {}


def _module_graph() -> dict[str, set[str]]:
    """Module -> the namespace's modules it imports at import time (not under TYPE_CHECKING, not
    inside functions). ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    tomllib = pytest.importorskip("tomllib")
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods: dict[str, pathlib.Path] = {}
    for name, folder in dirs.items():
        src = ROOT / folder
        for p in src.rglob("*.py"):
            rel = p.relative_to(src).with_suffix("").parts
            mods[".".join((name, *(rel[:-1] if rel[-1] == "__init__" else rel)))] = p
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else [node]:
                if isinstance(n, ast.Import):
                    deps |= {a.name for a in n.names if a.name in mods}
                elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                    deps |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in mods else n.module for a in n.names}
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_namespace():
    graph = _module_graph()
    assert len(graph) > 100 and "timeslice.lockd.plan" in graph
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]     # the check can fail


#: The parts of the namespace that are not the job library (``client/timeslice/``).
NOT_CLIENT = ("timeslice.common", "timeslice.lockd", "timeslice.nodeagent", "timeslice.proto",
              "timeslice.launcher", "timeslice.testing")


def _under(name: str, parts: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in parts)


def test_the_servers_stand_on_common_and_proto_alone():
    """lockd and the node agent import nothing from the job library (client/timeslice/), and the
    job-safe part of common/ nothing server-side (common/server/) and nothing of the job library."""
    graph = _module_graph()
    client = {m for m in graph if m.startswith("timeslice.") and not _under(m, NOT_CLIENT)} | {"timeslice"}
    assert "timeslice.holds" in client and "timeslice.sim.coop" in client        # the check can fail
    bad = {m: sorted(d & client) for m, d in graph.items()
           if _under(m, ("timeslice.lockd", "timeslice.nodeagent", "timeslice.common")) and d & client}
    assert bad == {}
    shared = {m: sorted(d for d in deps if _under(d, ("timeslice.common.server",)))
              for m, deps in graph.items()
              if _under(m, ("timeslice.common",)) and not _under(m, ("timeslice.common.server",))}
    assert {m: d for m, d in shared.items() if d} == {}
