"""Rules of shape the product code keeps, read from its syntax trees (no import, no server).

* One name, one class: no class name is defined twice across the product's modules, so a
  name in a log, a trace or a review means one thing (the generated ``*_pb2*`` stubs aside:
  their names are the API's).
* Narrow constructors: an ``__init__`` takes at most ``MAX_PARAMS`` parameters (``self``
  aside), so an object takes its collaborators and the rest is grouped into the objects it
  belongs to. The public faces a user constructs (``FACES``) are held to it by their
  positional parameters only: their keyword options are the documented API. Dataclasses are
  values, not collaborators, and have no ``__init__`` of their own here.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("client", "common", "lockd", "nodeagent", "launcher", "proto", "testing")
MAX_PARAMS = 10
#: module -> classes whose keyword-only options are their public API (README).
FACES = {"client/timeslice/aio.py": {"AsyncOrchestratorClient"}, "client/timeslice/client.py": {"OrchestratorClient"},
         "client/timeslice/integrations/slicing.py": {"TimeSlice"}}


def product_modules() -> list[pathlib.Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py")
                  if "_pb2" not in p.name and ".venv" not in p.parts)


def trees() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in product_modules()]


def test_no_class_name_is_defined_twice_across_the_product():
    where: dict[str, list[str]] = defaultdict(list)
    for path, tree in trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(path)
    twice = {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}
    assert not twice, "class names defined more than once (rename one): " + "; ".join(
        f"{name} in {', '.join(paths)}" for name, paths in twice.items())


def test_no_constructor_takes_more_than_ten_parameters():
    wide = []
    for path, tree in trees():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
                    continue
                a = fn.args
                positional = len(a.posonlyargs) + len(a.args) - 1            # self aside
                n = positional if cls.name in FACES.get(path, ()) else positional + len(a.kwonlyargs)
                if n > MAX_PARAMS:
                    wide.append(f"{path}::{cls.name} ({n})")
    assert not wide, f"constructors with more than {MAX_PARAMS} parameters (group them): {', '.join(wide)}"
