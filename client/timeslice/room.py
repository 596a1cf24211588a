"""An allocation that does not fit inside a hold makes room before it fails.

A grant is planned with the job's footprint (README, "Memory a grant admits"), but
a phase can still grow past it: a first hold whose declaration was short, a longer
generation. Other jobs parked on the GPU may still hold memory there, outside their
regions (their *residue*: a CUDA context, allocator blocks), which the node agent can
move to host memory by the checkpoint the planner uses for residue. So an allocation
that fails for lack of device memory, inside a hold:

1. asks the node agent, over the worker's channel (``CooperativeWorker.make_room``), to
   move parked residue off that GPU (the agent checks that the job holds the group);
2. retries, at most ``MAX_ATTEMPTS`` times in all;
3. raises only when nothing more can be freed, with a message that names what holds the
   device: jobs, their bytes, processes no job registered (``describe``).

Torch's caching allocator gives Python no hook that retries an allocation: its
out-of-memory observers (``torch._C._cuda_attach_out_of_memory_observer``) run after its
last retry, just before it raises (``benchmarks/gpu_oom_probe.py`` shows it on a GPU).
So the retry is at the allocation's call site: ``with_room(fn, ...)`` runs ``fn`` again
once room was made (``TorchMemory.with_room``; the simulated memories' ``scratch``),
which is right for a step that can be redone (a generation, a forward pass), never
half-way through an optimizer's update. Sans-IO apart from the two callables.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from timeslice.common.device_errors import NoRoom
from timeslice.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")
MAX_ATTEMPTS = 4          # the allocation, then at most three more after room was made
MAX_HOLDERS = 16          # holders named in an answer or a message


@dataclass(frozen=True)
class RoomAnswer:
    """What the agent did for a room request."""

    freed_bytes: int = 0                                      # moved off the device for it
    free_bytes: int = -1                                      # free on the device after (-1: unknown)
    holders: list[dict] = field(default_factory=list)         # [{"job"|"pid", "bytes", "what"}]
    message: str = ""                                         # why nothing (more) could be freed

    @classmethod
    def from_frame(cls, msg: dict) -> RoomAnswer:
        holders = [h for h in (msg.get("holders") or [])[:MAX_HOLDERS] if isinstance(h, dict)]
        return cls(int(msg.get("freed_bytes") or 0), int(msg.get("free_bytes", -1)), holders,
                   str(msg.get("message") or "")[:500])


# ask(device id, bytes needed) -> what the agent did
Ask = Callable[[str, int], RoomAnswer]


def describe(need: int, device: str, answer: RoomAnswer | None, cause: BaseException | None = None) -> str:
    """The message of an allocation that could not be given room: who holds the device."""
    parts = [f"out of device memory inside the hold: {_gb(need)} more needed on {device or 'the device'}"]
    if answer is None:
        parts.append("and no node agent could be asked to make room (no cooperative channel)")
    else:
        if answer.free_bytes >= 0:
            parts.append(f"{_gb(answer.free_bytes)} free")
        if answer.holders:
            parts.append("held by " + ", ".join(_holder(h) for h in answer.holders[:MAX_HOLDERS]))
        if answer.message:
            parts.append(answer.message)
    from timeslice.hooks import current_cap
    if current_cap():
        parts.append(f"this job's allocator is capped at {_gb(current_cap())}, what its grant of a fit group "
                     "admitted beside the other holders: declare a larger device_bytes_hint")
    if cause is not None:
        parts.append(f"the allocation said: {str(cause).splitlines()[0][:300]}")
    return "; ".join(parts)


def _holder(h: dict) -> str:
    who = f"job {h['job']}" if h.get("job") else f"pid {h.get('pid', '?')} (no job registered it)"
    what = f", {h['what']}" if h.get("what") else ""
    return f"{who} ({_gb(int(h.get('bytes') or 0))}{what})"


def _gb(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


def bytes_asked(err: BaseException, default: int) -> int:
    """The size the failed allocation asked for: torch says "Tried to allocate 1024.00 MiB"; else ``default``."""
    m = _TRIED.search(str(err))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else default


def with_room(alloc: Callable[[], T], *, need_bytes: int, device: str, ask: Ask | None,
              is_oom: Callable[[BaseException], bool], attempts: int = MAX_ATTEMPTS,
              before_retry: Callable[[], Any] | None = None,
              raise_as: Callable[[str, BaseException, RoomAnswer | None], BaseException] | None = None) -> T:
    """``alloc()``; if it fails with an out-of-memory error (``is_oom``), ask for room and try again.

    Raises ``NoRoom`` (or what ``raise_as(message, error, answer)`` makes: a framework's own
    out-of-memory type) once the agent freed nothing more, or after ``attempts`` tries.
    ``before_retry``: run before each retry (e.g. release the allocator's cache)."""
    last: RoomAnswer | None = None
    for attempt in range(1, max(1, attempts) + 1):
        try:
            return alloc()
        except Exception as e:
            if not is_oom(e):
                raise
            need = bytes_asked(e, need_bytes)
            answer = None if ask is None or attempt == attempts else ask(device, need)
            if answer is not None:
                last = answer
                log.info("room_asked", device=device, need_bytes=need, freed_bytes=answer.freed_bytes,
                         free_bytes=answer.free_bytes, attempt=attempt)
            if answer is None or answer.freed_bytes <= 0:
                msg = describe(need, device, answer if answer is not None else last, e)
                log.warning("room_exhausted", device=device, need_bytes=need, attempt=attempt, message=msg)
                told = answer or last
                if raise_as is not None:
                    raise raise_as(msg, e, told) from e
                raise NoRoom(msg, need_bytes=need, holders=told.holders if told is not None else [],
                             cu_result=2, cu_name="CUDA_ERROR_OUT_OF_MEMORY") from e
            if before_retry is not None:
                before_retry()
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def holders_text(holders: Sequence[dict]) -> str:
    return ", ".join(_holder(h) for h in holders[:MAX_HOLDERS])
