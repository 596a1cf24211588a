"""Rules of shape the product code keeps, read from its syntax trees (no import, no server).

* One name, one class: no class name is defined twice across the product's modules, so a
  name in a log, a trace or a review means one thing (the generated ``*_pb2*`` stubs aside:
  their names are the API's).
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("client", "common", "lockd", "nodeagent", "launcher", "proto", "testing")


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
