"""The shipped packages type-check (mypy) and lint (ruff) with zero findings (issue 14).

scripts/static_checks.py is the one way both run (it lays the namespace out for mypy); this test
runs it, so the README's test command holds the bar.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_zero_findings(tool):
    pytest.importorskip(tool)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "static_checks.py"), tool], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
