"""docs/ARCHITECTURE.md's checklists ("Add a swapper", "Add a lock RPC") name the files that matter.

* Every file a checklist names exists (``test_architecture_doc.py`` also resolves the ``::``
  references).
* Add a swapper: the registry and the interface are named, and so is every product module
  that reads the registry (``common/swaps.py``'s functions); an app server's kind (vllm,
  sglang) is spelled only in its swapper's module, the registry and the stand-in server:
  a new one is one module plus its registration.
* Add a lock RPC: every product module that spells a third or more of the API's methods in
  its code (names, attributes, strings; not prose) is named.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from timeslice.common import swaps
from timeslice.proto import lockd_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PRODUCT = ("client", "common", "lockd", "nodeagent", "launcher", "testing")
_FILE = re.compile(r"`((?:client|common|proto|lockd|nodeagent|launcher|testing|tests|scripts)/[A-Za-z0-9_./-]+"
                   r"\.(?:py|proto))(?:::[A-Za-z_.]+)?`")


def checklist(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end if end != -1 else len(text)]


def named(title: str) -> set[str]:
    return set(_FILE.findall(checklist(title)))


@functools.cache
def product_modules() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name)


@functools.cache
def code_words(path: Path) -> list[str]:
    """Names, attributes, function names and string constants of ``path`` (docstrings aside)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.append(n.value)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append(n.name)
    return out


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_file_a_checklist_names_exists():
    for title in ("Add a swapper", "Add a lock RPC"):
        files = named(title)
        assert len(files) >= 5, f"{title}: names only {sorted(files)}"
        missing = sorted(f for f in files if not (ROOT / f).exists())
        assert not missing, f"{title} names files that do not exist: {missing}"


def test_the_swapper_checklist_names_the_registry_its_readers_and_the_interface():
    files = named("Add a swapper")
    readers = {"kind_of", "swapper_kinds", "job_kinds", "swapper_class"}
    reading = {rel(p) for p in product_modules() if rel(p) not in ("common/swaps.py",)
               and readers & set(code_words(p))}
    assert reading, "nothing reads common/swaps.py"
    assert {"common/swaps.py", "nodeagent/backends/swapper.py"} <= files
    assert reading <= files, f"read the registry but not in the checklist: {sorted(reading - files)}"


def test_an_app_servers_kind_is_one_module_and_its_registration():
    for kind in (k for k in swaps.KINDS.values() if k.endpoint):
        module = kind.swapper.partition(":")[0].replace("timeslice.", "", 1).replace(".", "/") + ".py"
        cls = kind.swapper.partition(":")[2]
        constant = next(n for n, v in vars(swaps).items() if v == kind.name and n.isupper())
        spelled = {rel(p) for p in product_modules()
                   if {cls, constant} & set(code_words(p)) or kind.name in code_words(p)}
        allowed = {module, "common/swaps.py"} | {f for f in spelled if f.startswith("testing/standin/")}
        assert spelled <= allowed, f"{kind.name} is spelled outside its module: {sorted(spelled - allowed)}"


def test_the_rpc_checklist_names_the_files_every_rpc_is_spelled_in():
    files = named("Add a lock RPC")
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Lockd"].methods]
    words = {rel(p): code_words(p) for p in product_modules()}
    spells = {path: {m for m in methods if any(re.search(rf"\b{m}(Request|Reply)?\b", w) for w in ws)}
              for path, ws in words.items()}
    central = {path for path, ms in spells.items() if len(ms) * 3 >= len(methods)}
    assert {"lockd/servicer.py", "client/timeslice/retry.py", "common/rpcs.py"} <= central
    assert central <= files, f"spell a third of the API but are not in the checklist: {sorted(central - files)}"
