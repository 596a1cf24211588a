"""docs/ARCHITECTURE.md stays true to the code: its map lists every module, its references resolve.

* Map: every ``### `folder/` `` section lists each module of that folder (``name.py``, or a
  ``*`` pattern for the generated stubs), and every package folder, ``chaos_tests/`` and
  ``benchmarks/`` has such a section.
* References: ``path::Name.attr`` names a file that exists and, in it, a top-level function,
  class or assignment ``Name`` whose class body (or a ``self.attr = ...`` in one of its
  methods) defines ``attr``; a bare ``path.py`` exists; a bare ``Class.attr`` is defined by
  some class of that name in the repository.

No process starts: the files are parsed, not imported.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
NOT_SHIPPED = ["chaos_tests", "benchmarks"]
_TICKS = re.compile(r"`([^`\n]+)`")
_REF = re.compile(r"^([A-Za-z0-9_./-]+\.(?:py|proto|md))::([A-Za-z_][A-Za-z0-9_.]*)$")
_PATH = re.compile(r"^(?:client|common|proto|lockd|nodeagent|launcher|testing|tests|chaos_tests|benchmarks|scripts|"
                   r"deploy|examples|docs)/[A-Za-z0-9_./-]+\.(?:py|proto|md|sh|env|yaml)$")
_CLASS_ATTR = re.compile(r"^([A-Z][A-Za-z0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)$")


def doc() -> str:
    return DOC.read_text()


def folders() -> list[str]:
    """Every folder of a shipped package (pyproject's package-dir map and subpackages), then the rest."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out = []
    for pkg in cfg["packages"]:
        base = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        rest = pkg[len(base):].lstrip(".")
        out.append("/".join(x for x in [dirs[base], *rest.split(".")] if x))
    return out + NOT_SHIPPED


def sections(text: str) -> dict[str, str]:
    """``folder/`` -> the text of its ``### `folder/` ...`` section."""
    out: dict[str, str] = {}
    parts = re.split(r"^### ", text, flags=re.M)
    for part in parts[1:]:
        m = re.match(r"`([^`]+)/`", part)
        if m:
            out[m.group(1)] = part.split("\n## ", 1)[0]
    return out


def modules(folder: str) -> list[str]:
    d = ROOT / folder
    return sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix in (".py", ".proto"))


def test_the_map_lists_every_module_of_every_folder():
    found = sections(doc())
    missing_sections = [f for f in folders() if f not in found]
    assert not missing_sections, f"docs/ARCHITECTURE.md has no '### `folder/`' section for {missing_sections}"
    unlisted = []
    for folder in folders():
        names = set(_TICKS.findall(found[folder]))
        patterns = [n for n in names if "*" in n]
        for mod in modules(folder):
            if mod not in names and not any(fnmatch.fnmatch(mod, p) for p in patterns):
                unlisted.append(f"{folder}/{mod}")
    assert not unlisted, f"modules missing from the map in docs/ARCHITECTURE.md: {unlisted}"


def test_the_map_lists_no_module_that_is_gone():
    stale = []
    for folder, text in sections(doc()).items():
        if not (ROOT / folder).is_dir():
            stale.append(f"{folder}/ (no such folder)")
            continue
        for row in re.findall(r"^\| (`[^|]+) \|", text, flags=re.M):
            for name in _TICKS.findall(row):
                if (name.endswith((".py", ".proto")) and "*" not in name and "/" not in name
                        and not (ROOT / folder / name).exists()):
                    stale.append(f"{folder}/{name}")
    assert not stale, f"the map names modules that do not exist: {stale}"


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    attrs = set(_names(cls.body))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    attrs.add(el.attr)
    return attrs


def resolves(path: str, dotted: str) -> str:
    """"" if ``dotted`` is defined in ``path``, else why not."""
    if not (ROOT / path).is_file():
        return f"{path} does not exist"
    if not path.endswith(".py"):
        return ""
    first, *rest = dotted.split(".")
    node = _names(_tree(path).body).get(first)
    if node is None:
        return f"{path} defines no {first!r}"
    if rest:
        if not isinstance(node, ast.ClassDef):
            return f"{path}::{first} is not a class, so it has no {rest[0]!r}"
        if rest[0] not in _class_attrs(node):
            return f"{path}::{first} has no {rest[0]!r}"
    return ""


@functools.cache
def _all_classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for folder in {f.split("/")[0] for f in folders()} | {"tests"}:
        for p in (ROOT / folder).rglob("*.py"):
            if "_pb2" in p.name:
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name, []).append(node)
    return out


def test_every_reference_resolves():
    bad = []
    for token in sorted(set(_TICKS.findall(doc()))):
        m = _REF.match(token)
        if m:
            why = resolves(m.group(1), m.group(2))
        elif _PATH.match(token):
            why = "" if (ROOT / token).exists() else f"{token} does not exist"
        elif (c := _CLASS_ATTR.match(token)) and c.group(1) in _all_classes():
            why = "" if any(c.group(2) in _class_attrs(k) for k in _all_classes()[c.group(1)]) \
                else f"no class {c.group(1)} defines {c.group(2)!r}"
        else:
            continue
        if why:
            bad.append(f"`{token}`: {why}")
    assert not bad, "docs/ARCHITECTURE.md names what is not there:\n" + "\n".join(bad)


def test_references_are_checked_at_all():
    # The grammar above must keep matching the doc: a reformat that hid every reference from it
    # would make the test above pass vacuously.
    refs = [t for t in _TICKS.findall(doc()) if _REF.match(t)]
    assert len(refs) > 100, len(refs)
