"""Habits that help the next person: a LICENSE matching pyproject, PEP 561
markers shipped in the wheel, classifiers, and one version for __version__ and --version."""
from __future__ import annotations

import importlib
import os
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


def test_one_namespace_every_package_folder_listed():
    """The wheel installs one top-level name; each package folder is listed under it, nothing else is."""
    setup = PROJECT["tool"]["setuptools"]
    listed, dirs = set(setup["packages"]), setup["package-dir"]
    assert {name.split(".")[0] for name in listed} == {"timeslice"}
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in dirs.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found == listed
    assert not any(p.split(".")[1:2] in (["tests"], ["chaos_tests"], ["benchmarks"]) for p in listed)


def test_one_folder_per_import_name():
    """``timeslice.X`` lives in top-level ``X/``; the bare ``timeslice`` (the job client) in ``client/timeslice/``."""
    dirs = dict(PROJECT["tool"]["setuptools"]["package-dir"])
    assert dirs.pop("timeslice") == "client/timeslice"
    assert dirs == {name: name.removeprefix("timeslice.") for name in dirs}
    assert all("." not in name.removeprefix("timeslice.") for name in dirs)


def test_the_namespace_is_typed_and_versioned():
    assert (ROOT / "client/timeslice/py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["timeslice"]
    for package in ("timeslice", "timeslice.lockd", "timeslice.nodeagent", "timeslice.common.version"):
        mod = importlib.import_module(package)
        assert mod.__version__ in (PROJECT["project"]["version"], "0+unknown"), package


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
    assert not any(p.startswith("chaos_tests") for p in PROJECT["tool"]["setuptools"]["packages"])


def test_the_test_extra_brings_jax_and_ci_has_it():
    """The JAX tests (tests/integrations/test_jax_*.py, the JAX README snippet, the JAX dry runs) skip where
    JAX is missing; CI installs the test extra, so there they must run: a CI without JAX fails here."""
    test = PROJECT["project"]["optional-dependencies"]["test"]
    assert any(d.replace(" ", "").startswith("jax[cpu]") for d in test), test
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        import jax
        assert jax.devices("cpu")
