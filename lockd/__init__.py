"""lockd: the orchestrator replica (``lockd serve``)."""
from timeslice.common.version import __version__

__all__ = ["__version__"]
