"""Habits that help the next person (issue #14): a LICENSE matching pyproject, PEP 561
markers shipped in the wheel, classifiers, and one version for __version__ and --version."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_declared_license():
    assert PROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "LICENSE" in PROJECT["project"]["license-files"]


@pytest.mark.parametrize("package, folder", [("timeslice", "client/timeslice"), ("tscore", "tscore"),
                                             ("lockd", "lockd"), ("nodeagent", "nodeagent")])
def test_packages_are_typed_and_versioned(package, folder):
    assert (ROOT / folder / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"][package]
    mod = importlib.import_module(package) if package != "tscore" else importlib.import_module("tscore.version")
    assert mod.__version__ in (PROJECT["project"]["version"], "0+unknown")


def test_classifiers_and_no_urls():
    classifiers = PROJECT["project"]["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)   # the SPDX license field says it
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)
    # No project URLs: nothing in this repository names a host it would publish to.
    assert "urls" not in PROJECT["project"]


def test_a_plain_install_is_the_lean_job_client():
    """`pip install .` gives what an RL job imports; lockd/agent/launcher dependencies are the `server` extra."""
    base = {d.split(">")[0].split("=")[0].split(";")[0].strip() for d in PROJECT["project"]["dependencies"]}
    assert base == {"grpcio", "protobuf", "tenacity", "structlog"}
    server = " ".join(PROJECT["project"]["optional-dependencies"]["server"])
    for dep in ("aetcd", "prometheus-client", "nvidia-ml-py", "grpcio-health-checking"):
        assert dep in server
    assert not any(p.startswith("chaos_tests") for p in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
