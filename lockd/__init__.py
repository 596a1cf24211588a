"""lockd: the orchestrator replica (``lockd serve``)."""
from tscore.version import __version__

__all__ = ["__version__"]
