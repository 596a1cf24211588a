"""Code and documents cite only what is in the repository.

The project's design handbook and its issue tracker are not part of the repository, so a
comment that says "see DESIGN.md §6" or "(issue 17)" sends the reader nowhere. Cite
docs/ARCHITECTURE.md (its invariants and sections), the README, benchmarks/results/ or a test
instead. This walks every text file of the checkout (generated stubs and measurement data
aside) and fails naming each citation of something outside it.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build", "dist"}
TEXT = {".py", ".pyi", ".md", ".toml", ".yaml", ".yml", ".sh", ".env", ".proto", ".cfg", ".ini", ".txt", ""}
# "(#15)", "(strict, #15)", "#15 item 4", "in #14"; not a Markdown anchor such as "(#1-the-map)"
OUTSIDE = re.compile(r"DESIGN\.md|\b[Ii]ssues?[ -]#?\d+|[(, ]#\d+[),;:]|#\d+ items?\b|\bin #\d+\b|§\d")


def _tracked_or_new() -> list[Path] | None:
    """The checkout's own files (tracked, or new and not ignored): what a commit would carry.
    Ignored folders (a venv, wheels, a frozen tree carried to a GPU machine) are not the repo's."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None                   # not a git checkout (an sdist): walk the folder instead
    return [ROOT / f for f in out.decode().split("\0") if f]


def text_files() -> list[Path]:
    out = []
    listed = _tracked_or_new()
    for p in (listed if listed is not None else ROOT.rglob("*")):
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts):
            continue
        if not p.is_file() or p.suffix not in TEXT or "_pb2" in p.name or p.name == "LICENSE":
            continue
        if p.suffix == ".txt" and "results" in p.parts:
            continue                  # measurement logs: what a run printed, kept as it was
        out.append(p)
    return out


def test_nothing_cites_what_is_not_in_the_repository():
    here = Path(__file__).resolve()
    found = []
    for p in text_files():
        if p == here:
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "citations of what is not in the repository:\n" + "\n".join(found)


def test_the_walk_sees_the_code():
    names = {p.relative_to(ROOT).as_posix() for p in text_files()}
    assert {"README.md", "lockd/plan.py", "docs/ARCHITECTURE.md", "deploy/local.env"} <= names
