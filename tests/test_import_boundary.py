"""Import boundaries: what an RL job imports stays lean, and product code never imports the test harness.

The job client (``timeslice``, its cooperative side included) must not pull in lockd, the node
agent, the etcd client (aetcd), the test harness, or PyTorch (imported lazily by TorchMemory only).
Checked in a fresh interpreter, so nothing imported by the test session itself hides a leak.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN = ("timeslice.lockd", "timeslice.nodeagent", "aetcd", "timeslice.testing", "timeslice.common.etcd",
             "torch", "torch_memory_saver", "prometheus_client", "pynvml")
#: The top-level names the packages had before they moved under one namespace (issue 14).
OLD_NAMES = ("lockd", "nodeagent", "tscore", "tsproto")

PROBE = """
import sys
import timeslice, timeslice.cooperative, timeslice.channel, timeslice.torch_memory
from timeslice import OrchestratorClient, AsyncOrchestratorClient, TimeSliceOrchestratorClient
bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in sys.argv[1:]))
print(",".join(bad))
"""


def test_the_job_client_imports_nothing_server_side():
    out = subprocess.run([sys.executable, "-c", PROBE, *FORBIDDEN], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the job client imported: {out.stdout.strip()}"


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
    product = [p for d in ("lockd", "nodeagent", "client/timeslice", "tscore") for p in (ROOT / d).rglob("*.py")
               if "tscore/testing" not in p.as_posix()]
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("timeslice.testing"))
                 for p in product}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_nothing_imports_the_old_top_level_names():
    """Everything lives under ``timeslice``; an import of ``lockd`` (say) would only work by accident."""
    files = [p for d in ("lockd", "nodeagent", "client", "tscore", "proto", "tests", "chaos_tests", "benchmarks",
                         "examples", "scripts") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 100
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] in OLD_NAMES)
                 for p in files}
    assert {p: n for p, n in offenders.items() if n} == {}
