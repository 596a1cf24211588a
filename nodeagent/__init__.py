"""nodeagent: the node agent of one GPU node (``nodeagent serve``)."""
from timeslice.common.version import __version__

__all__ = ["__version__"]
