"""The shipped packages type-check (mypy) and lint (ruff) with zero findings.

scripts/static_checks.py is the one way both run (it lays the namespace out for mypy); this test
runs it, so the README's test command holds the bar. The tools come with the ``test`` extra: a
missing one is a broken set-up, and the test fails saying so instead of skipping (a skip would let
the bar drop silently on a machine that lacks them).
"""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
@pytest.mark.slow
def test_zero_findings(tool):
    assert importlib.util.find_spec(tool) is not None, (
        f"{tool} is not installed in {sys.executable}: it comes with the test extra "
        "(pip install -e '.[server,test]'); the static checks cannot be skipped")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "static_checks.py"), tool], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
