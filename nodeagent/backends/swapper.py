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

The kinds are listed in ``timeslice.common.swaps``; the agent builds a worker's swapper
with ``swapper_class(kind).for_worker(env, ...)``. What a kind with tagged regions says of
them (``tags``, ``region_bytes``, ...) is on the interface, answered "none" by default.
"""
from __future__ import annotations

import abc
import enum
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from timeslice.common import swaps
from timeslice.common.device_errors import BackendError
from timeslice.common.server import records as R


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


class SwapConfigError(BackendError):
    """The worker's registration cannot be served by this swapper (bad URL, tags, kind)."""

    code = "INVALID_ARGUMENT"


@dataclass(frozen=True)
class SwapEnv:
    """What the agent hands every swapper it builds."""

    channel: Any = None                 # nodeagent/channel.py::ChannelServer: the cooperative workers' channel
    reconnects: Any = None              # nodeagent/reconnects.py::Reconnects: the wait for one that is away
    meter: Any = None                   # verifies an app server's memory: a DeviceMeter, or the checkpoint Backend
    drain_s: float | None = None        # an app server's drain before its pause (None: half the deadline)
    on_drain_timeout: str = "refuse"


class Swapper(abc.ABC):
    """Moves one worker's memory by asking it. Subclasses set ``kind`` (a name in ``common/swaps.py``)."""

    kind: str = "abstract"

    @classmethod
    @abc.abstractmethod
    def for_worker(cls, env: SwapEnv, pid: int, job: str, worker: R.WorkerValue | None) -> Swapper:
        """The swapper of ``pid`` (of ``job``; ``worker``: its registration, None if it has none any more)."""

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

    def tags(self) -> dict[str, str]:
        """Its regions: tag -> policy (``offload`` or ``discard``); {} for a swapper without regions."""
        return {}

    def region_bytes(self) -> dict[str, int]:
        """Bytes per region (tag -> bytes)."""
        return {}

    def resident_regions(self) -> dict[str, int]:
        """tag -> bytes of the regions on the device now: what a (further) pause can release."""
        return {}

    def releasable_bytes(self) -> int:
        """Device bytes a further pause could free (regions a selective pause kept resident)."""
        return sum(self.resident_regions().values())

    def residue_bytes(self) -> int | None:
        """What the paused worker still holds on the device outside its regions (None: not known)."""
        return None

    def device(self) -> str:
        """The device its memory is on ("" : not known)."""
        return ""

    def close(self) -> None:  # noqa: B027 - optional: a swapper may hold nothing
        """Forget the worker (channel closed, server gone). Idempotent."""


def swapper_class(kind: str) -> type[Swapper]:
    """The agent's ``Swapper`` class for the swap ``kind`` (``common/swaps.py``); SwapConfigError if the
    kind has none (``checkpoint``: the checkpoint backend moves it) or is not on the list."""
    k = swaps.kind_of(kind)
    if k is None or not k.swapper:
        raise SwapConfigError(f"no swapper for swap={kind[:32]!r} (one of {swaps.swapper_kinds()})")
    module, _, name = k.swapper.partition(":")
    return getattr(importlib.import_module(module), name)
