"""Rules of shape the product code keeps, read from its syntax trees (no import, no server).

* One name, one class: no class name is defined twice across the product's modules, so a
  name in a log, a trace or a review means one thing (the generated ``*_pb2*`` stubs aside:
  their names are the API's).
* Narrow constructors: an ``__init__`` takes at most ``MAX_PARAMS`` parameters (``self``
  aside), so an object takes its collaborators and the rest is grouped into the objects it
  belongs to. The public faces a user constructs (``FACES``) are held to it by their
  positional parameters only: their keyword options are the documented API. Dataclasses are
  values, not collaborators, and have no ``__init__`` of their own here.
* No hidden loops: in the wiring rooms (``WIRING``), no lambda handed to a room reads a room
  built after it or built from it; such a loop goes through a named callback or protocol, which
  the wiring spells (``lockd/replica.py``'s ``_job_fractions``, ``client/timeslice/aio.py``'s
  ``GrantReturn``). It finds the lambda loops of 4a35e3a (``nodeagent/agent.py``, ``aio.py``).
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


#: The rooms that wire the others together (their constructors and start-up functions).
WIRING = ("nodeagent/agent.py", "nodeagent/server.py", "lockd/replica.py", "lockd/server.py",
          "client/timeslice/aio.py", "client/timeslice/client.py", "launcher/servers.py")


def _room(node: ast.AST) -> str | None:
    """The room an expression starts from: ``self.x...`` -> "self.x", ``x...`` -> "x"."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return f"self.{node.attr}"
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) and node.id != "self" else None


def _rooms_read(node: ast.AST, skip_lambdas: bool) -> set[str]:
    out: set[str] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if skip_lambdas and isinstance(n, ast.Lambda):
            continue
        if isinstance(n, (ast.Attribute, ast.Name)) and (room := _room(n)) is not None:
            out.add(room)
        todo.extend(ast.iter_child_nodes(n))
    return out


def lambda_loops(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Lambdas in a wiring function that close a loop: one handed to (or set on) room A that reads
    a room B which is built after it (late-bound), is A itself, or was built from A."""
    built: dict[str, int] = {}
    deps: dict[str, set[str]] = defaultdict(set)
    handed: list[tuple[int, str, set[str]]] = []                # (line, receiver, rooms the lambda reads)
    for i, st in enumerate(fn.body):
        value = getattr(st, "value", None)
        if value is None:
            continue
        targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
        flat = [e for t in targets if t is not None for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        made = [_room(e) for e in flat if isinstance(e, ast.Name) or (
            isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self")]
        for n in made:                                          # `self.a = ...` / `a = ...` builds room a
            built.setdefault(n, i)
            deps[n] |= _rooms_read(value, skip_lambdas=True) - {n}
        receivers = {n for n in (_room(e) for e in flat) if n} or {_room(value)} - {None}
        for lam in (n for n in ast.walk(value) if isinstance(n, ast.Lambda)):
            for r in receivers:
                handed.append((i, r, _rooms_read(lam.body, skip_lambdas=False) - set(a.arg for a in lam.args.args)))

    def reaches(b: str, a: str) -> bool:
        seen, todo = set(), [b]
        while todo:
            x = todo.pop()
            if x == a:
                return True
            if x not in seen:
                seen.add(x)
                todo.extend(deps.get(x, ()))
        return False
    return [f"line {fn.body[i].lineno}: a lambda given to {r} reads {b}"
            for i, r, reads in handed for b in sorted(reads)
            if b in built and (built[b] >= i or reaches(b, r))]


def test_no_lambda_closes_a_loop_in_the_wiring_rooms():
    loops = []
    for path in WIRING:
        tree = ast.parse((ROOT / path).read_text(), path)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            loops += [f"{path}::{fn.name} {why}" for why in lambda_loops(fn)]
    assert not loops, "loops closed by a lambda (name the callback, or merge the rooms): " + "; ".join(loops)
