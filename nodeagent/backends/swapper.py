"""The second kind of backend: a *swapper* asks the worker to move its own memory.

A checkpoint backend (``base.Backend``) moves a whole process's CUDA context
from outside. A swapper instead asks the process — or the inference server it
runs — to release its device memory and take it back later:

* ``cooperative``: the job's process, over the node-local channel it opened
  when it registered (``nodeagent.channel``; torch-memory-saver or a
  pause/resume pair the job supplies);
* ``vllm`` / ``sglang``: the server's own HTTP API (``app_endpoint``).

One swapper serves one worker process. Calls are blocking and thread-safe
(several workers of a job are driven in parallel by ``backends.ops`` through
``backends.composite``), and each carries a deadline: a worker that does not
answer in time is a failed swap (``SwapTimeout``), reported to the waiter, and
nothing of its memory is released by the agent.

``pause(tags)`` releases the regions named (``None``: all of them), copying
``offload`` regions to host memory and dropping ``discard`` regions;
``resume()`` brings back what the last pause released. Both are idempotent:
pausing a paused worker or resuming a running one reports zero bytes moved.
"""
from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from timeslice.common.device_errors import BackendError


class SwapState(str, enum.Enum):
    RUNNING = "running"      # its memory is on the device
    PAUSED = "paused"        # released (offloaded to host or discarded)
    GONE = "gone"            # the process or server is not there (any more)
    UNKNOWN = "unknown"      # it did not answer

    def __str__(self) -> str:
        return self.value


@dataclass
class SwapReport:
    """What one pause or resume did."""

    bytes_moved: int = 0                # bytes copied between device and host
    device_bytes: int = 0               # device bytes released (pause) or taken back (resume)
    elapsed_ms: float = 0.0
    tags: list[str] = field(default_factory=list)   # the regions it acted on
    detail: dict = field(default_factory=dict)       # backend-specific figures (for logs)


class SwapTimeout(BackendError):
    """The worker did not answer within its deadline; treated as a failed swap."""

    code = "DEADLINE_EXCEEDED"


class SwapRefused(BackendError):
    """The worker answered that it cannot do it (e.g. a region in use); nothing was released."""

    code = "FAILED_PRECONDITION"


class Swapper(abc.ABC):
    """Moves one worker's memory by asking it. Subclasses set ``kind``."""

    kind: str = "abstract"

    @abc.abstractmethod
    def state(self) -> SwapState:
        """Where the worker's memory is now. Never raises for a gone worker (GONE)."""

    @abc.abstractmethod
    def pause(self, tags: Sequence[str] | None, deadline_s: float) -> SwapReport:
        """Release the regions ``tags`` (None: all); raise SwapTimeout / SwapRefused / ProcessGone."""

    @abc.abstractmethod
    def resume(self, deadline_s: float) -> SwapReport:
        """Bring back what the last pause released; raise SwapTimeout / SwapRefused / ProcessGone."""

    def paused_bytes(self) -> int | None:
        """Device bytes the last pause released and a resume will need again (None: unknown)."""
        return None

    def host_bytes(self) -> int:
        """Host memory this worker keeps for its offloaded regions (retained pinned backup)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional: a swapper may hold nothing
        """Forget the worker (channel closed, server gone). Idempotent."""
