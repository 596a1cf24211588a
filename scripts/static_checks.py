#!/usr/bin/env python3
"""Type check (mypy) and lint (ruff) the shipped packages: zero findings is the bar (issue 14).

The packages live in the card's folders and install as one namespace through pyproject's
package-dir map, which mypy cannot follow through an editable install's import hook. So the
namespace is laid out as a tree of symbolic links in a temporary folder (one link per module
file, built from the same map) and mypy checks ``-p timeslice`` there; findings are reported
with the real paths. ruff reads the folders directly. Usage: python scripts/static_checks.py
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def package_map() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def link_tree(dest: pathlib.Path) -> dict[str, str]:
    """Lay the namespace out under dest with one symlink per file; returns link path -> real path."""
    real_of: dict[str, str] = {}
    mapping = package_map()
    own = {ROOT / folder for folder in mapping.values()}
    for name, folder in sorted(mapping.items()):
        src = ROOT / folder
        for path in src.rglob("*"):
            if path.is_dir() or path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            # a sub-folder mapped to a name of its own (tscore/testing) is laid out under that name
            if any(p != src and p in own and path.is_relative_to(p) for p in own):
                continue
            target = dest.joinpath(*name.split("."), path.relative_to(src))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
            real_of[str(target)] = str(path.relative_to(ROOT))
    return real_of


def run_mypy() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        real_of = link_tree(pathlib.Path(tmp))
        env = {**os.environ, "MYPYPATH": tmp}
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                              "-p", "timeslice"], cwd=tmp, env=env, capture_output=True, text=True)
        text = out.stdout + out.stderr
        for link, real in sorted(real_of.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(os.path.relpath(link, tmp), real)
        print(text, end="")
        return out.returncode


def run_ruff() -> int:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "client", "lockd", "nodeagent", "tscore", "proto"],
                          cwd=ROOT).returncode


if __name__ == "__main__":
    which = sys.argv[1:] or ["mypy", "ruff"]
    rc = 0
    if "ruff" in which:
        rc |= run_ruff()
    if "mypy" in which:
        rc |= run_mypy()
    sys.exit(rc)
