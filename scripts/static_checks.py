#!/usr/bin/env python3
"""Type check (mypy) and lint (ruff) the shipped packages: zero findings is the bar.

Each part of the namespace is a top-level folder (``timeslice.X`` in ``X/``, the bare ``timeslice``
in ``client/timeslice/``: pyproject's package-dir map). ruff reads the folders directly. mypy finds
modules by path only (the editable install's import hook is invisible to it), so ``timeslice`` is
laid out in a temporary folder: a link per entry of client/timeslice/ plus one link per other
part (``timeslice/common`` -> ``common/``, ...), and mypy checks ``-p timeslice`` there; findings
are reported with the real paths. A tool that is not installed (both come with the ``test``
extra) is an error, not a pass. Usage: python scripts/static_checks.py [ruff] [mypy]
"""
from __future__ import annotations

import importlib.util
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
    """Lay ``timeslice`` out under dest with links to the real folders; returns link prefix -> real prefix."""
    real_of: dict[str, str] = {}
    for name, folder in sorted(package_map().items()):
        link = dest.joinpath(*name.split("."))
        if name == "timeslice":           # the root package: its entries, so the other parts can sit beside them
            link.mkdir(parents=True, exist_ok=True)
            for entry in (ROOT / folder).iterdir():
                if entry.name != "__pycache__":
                    (link / entry.name).symlink_to(entry)
        else:
            link.symlink_to(ROOT / folder, target_is_directory=True)
        real_of[link.relative_to(dest).as_posix() + "/"] = folder + "/"
    return real_of


def run_mypy() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        real_of = link_tree(pathlib.Path(tmp))
        env = {**os.environ, "MYPYPATH": tmp}
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                              "-p", "timeslice"], cwd=tmp, env=env, capture_output=True, text=True)
        lines = []
        for line in (out.stdout + out.stderr).splitlines(keepends=True):
            # the longest prefix first: timeslice/common/ before timeslice/
            for link, real in sorted(real_of.items(), key=lambda kv: -len(kv[0])):
                if line.startswith(link):
                    line = real + line[len(link):]
                    break
            lines.append(line)
        print("".join(lines), end="")
        return out.returncode


def run_ruff() -> int:
    folders = sorted({folder.split("/")[0] for folder in package_map().values()})
    return subprocess.run([sys.executable, "-m", "ruff", "check", *folders], cwd=ROOT).returncode


def missing(tool: str) -> bool:
    if importlib.util.find_spec(tool) is not None:
        return False
    print(f"static_checks: {tool} is not installed in {sys.executable} (pip install -e '.[test]')", file=sys.stderr)
    return True


if __name__ == "__main__":
    which = sys.argv[1:] or ["mypy", "ruff"]
    if any([missing(tool) for tool in which]):
        sys.exit(2)
    rc = 0
    if "ruff" in which:
        rc |= run_ruff()
    if "mypy" in which:
        rc |= run_mypy()
    sys.exit(rc)
