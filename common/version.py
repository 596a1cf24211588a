"""The installed distribution's version, for ``--version``, ``__version__`` and ``timeslice_build_info``.

Read from the package metadata (pyproject.toml's ``version``), so it is written
in one place; a source tree used without installing reports ``0+unknown``.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

DISTRIBUTION = "timeslice"

try:
    __version__ = _version(DISTRIBUTION)
except PackageNotFoundError:   # a source checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"
