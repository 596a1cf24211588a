"""SIMULATED GPU memory for a real PyTorch job on the CPU: its tensors, really taken away on pause.

The CPU stand-in for ``timeslice.torch_memory.TorchMemory``, so that a real
model (transformers, TRL) can be time-sliced in CI, where there is no GPU. It
is a simulator and says so; what it keeps of the real thing:

* the job's tensors (a module's parameters and buffers, an optimizer's state)
  stay ordinary CPU tensors; they are *adopted* into tagged regions
  (``adopt(tag, tensors)``: on a GPU, torch-memory-saver routes them there
  when they are allocated inside ``region(tag)``; a CPU tensor has no such
  allocator, so here ``region()`` is an empty block and adoption does it);
* the process's holding on the node's simulated device (the capacity ledger
  the agent and lockd plan from) is a small "context" plus the bytes of every
  resident region, so capacity is enforced and swaps are planned as on a GPU;
* ``pause`` copies an ``offload`` region's storages into a host backup kept
  between swaps (allocated once, like a retained pinned backup), then fills
  every byte of them with 0xFF: NaN in every floating-point format, -1 in the
  integers. The memory is gone, as a released device page is: a phase that
  runs outside its hold computes with NaN, and its losses and weights no
  longer equal those of the same job run alone, bit for bit, which is what
  the tests compare. ``discard`` regions are poisoned without a copy and come
  back zeroed;
* ``resume`` reserves the room on the ledger first (DeviceOutOfMemory if it
  does not fit), copies the backup back and checks its checksum;
* ``residue_bytes()`` is what the process still holds on the simulated device
  outside its regions: the context, a small arena of real bytes, which the
  agent's checkpoint takes where a strict group asks for full isolation;
* its ``DeviceStats`` (``timeslice.memstats``) are the allocator's figures (the
  resident regions, with the device's allocator slack) and the meter's; the
  host backups ``prepin`` allocates are admitted by the node agent first.

Storages, not tensors, are the unit (tied weights and views share one), and
the poisoning writes the storage directly, so autograd's version counters are
not touched (nor are they by torch-memory-saver on a GPU).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

from timeslice.common.device_errors import IllegalState
from timeslice.common.sim.device import device_id
from timeslice.sim.runtime import SimDeviceClient, SimStats

DEFAULT_TAGS = {"weights": "offload", "optimizer": "offload"}
DEFAULT_CONTEXT_BYTES = 256 << 10
POISON = 0xFF


def _digest(storage) -> str:
    import torch
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return hashlib.sha256(view.numpy().data).hexdigest()


class SimTorchMemory(SimStats):
    """SIMULATOR. Tagged regions of adopted CPU tensors, accounted on the simulated device."""

    def __init__(self, tags: Mapping[str, str] | None = None, sim_dir: str | os.PathLike | None = None,
                 context_bytes: int = DEFAULT_CONTEXT_BYTES, gpu: int | None = None):
        self.tags = dict(DEFAULT_TAGS if tags is None else tags)
        for tag, policy in self.tags.items():
            if policy not in ("offload", "discard"):
                raise ValueError(f"tag {tag!r}: policy must be offload or discard, got {policy!r}")
        self.context_bytes = int(context_bytes)
        self.dev = SimDeviceClient.open(sim_dir, gpu)
        self.dev.alloc(self.context_bytes)     # the "CUDA context": what a checkpoint of the rest moves
        self._storages: dict[str, dict[int, object]] = {t: {} for t in self.tags}   # tag -> data_ptr -> storage
        self._host: dict[str, dict[int, object]] = {t: {} for t in self.tags}       # retained backups
        self._sha: dict[str, dict[int, str]] = {t: {} for t in self.tags}
        self._released: set[str] = set()
        self._closed = False
        self._mu = threading.Lock()            # adopt (job thread) against pause/resume (channel thread)
        self.pauses = 0
        self._peak = 0
        self._admit = None                     # the node agent's host admission (the worker sets it)
        self._account()

    # -- what the job does -------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Where TorchMemory routes allocations to ``tag``; CPU tensors are adopted instead."""
        if tag not in self.tags:
            raise ValueError(f"unknown tag {tag!r}; declared: {sorted(self.tags)}")
        yield

    def adopt(self, tag: str, tensors: Iterable) -> int:
        """Put the storages of ``tensors`` into region ``tag`` (again is harmless); returns the bytes added."""
        if tag not in self.tags:
            raise ValueError(f"unknown tag {tag!r}; declared: {sorted(self.tags)}")
        added = 0
        with self._mu:
            if tag in self._released:
                raise IllegalState(f"simulated device: region {tag!r} is released (adopting outside a hold)",
                                   pid=self.dev.pid)
            known = {p for regions in self._storages.values() for p in regions}
            for t in tensors:
                s = t.untyped_storage()
                if t.device.type != "cpu" or s.data_ptr() in known or s.nbytes() == 0:
                    continue
                known.add(s.data_ptr())
                self._storages[tag][s.data_ptr()] = s
                added += s.nbytes()
            if added:
                self._account()
        return added

    def is_paused(self, tag: str) -> bool:
        return tag in self._released

    # -- what the channel asks ------------------------------------------------------------
    def sim_dir(self) -> str:
        """The simulated device this memory is on (resolved): the node agent's must be the same."""
        return self.dev.root()

    def device_id(self) -> str:
        return device_id(self.dev.gpu)

    def region_bytes(self) -> dict[str, int]:
        if self._closed:
            return {t: 0 for t in self.tags}
        return {t: sum(s.nbytes() for s in regions.values()) for t, regions in self._storages.items()}  # type: ignore[attr-defined]

    def host_bytes(self) -> int:
        return sum(s.nbytes() for backups in self._host.values() for s in backups.values())  # type: ignore[attr-defined]

    def residue_bytes(self) -> int:
        """What this process still holds on the simulated device outside its resident regions."""
        resident = sum(n for t, n in self.region_bytes().items() if t not in self._released)
        return max(0, self.dev.device_bytes - resident)

    def peak_bytes(self) -> int:
        """The footprint with every region resident: what the job needs on the device to run."""
        return self.context_bytes + sum(self.region_bytes().values())

    def _allocator(self) -> int:
        sizes = self.region_bytes()
        return self.dev.dev.allocator_bytes(sum(n for t, n in sizes.items() if t not in self._released))

    def set_host_admission(self, admit) -> None:
        self._admit = admit

    def pause(self, tags: Sequence[str]) -> None:
        with self._mu:
            if self._closed:
                return                           # nothing left on the device to move
            for t in tags:
                with self.dev._device(None):     # copying device memory is device work: waits while frozen
                    self._pause_one(t)
            self.pauses += 1

    def _pause_one(self, tag: str) -> None:
        if tag in self._released:
            return
        for key, s in self._storages[tag].items():
            if self.tags[tag] == "offload":
                backup = self._host[tag].get(key)
                if backup is None:               # the first pause allocates the backup, once
                    backup = self._host[tag][key] = s.clone()   # type: ignore[attr-defined]
                else:
                    backup.copy_(s)              # type: ignore[attr-defined]
                self._sha[tag][key] = _digest(backup)
            s.fill_(POISON)                      # type: ignore[attr-defined]
        self._released.add(tag)
        self._account()                          # only now is the device memory given back

    def resume(self, tags: Sequence[str]) -> None:
        with self._mu:
            if self._closed:
                return
            for t in tags:
                if t not in self._released:
                    continue
                self._released.discard(t)
                try:
                    self._account()              # reserve the room before touching anything
                except Exception:
                    self._released.add(t)
                    raise
                for key, s in self._storages[t].items():
                    if self.tags[t] == "offload":
                        s.copy_(self._host[t][key])                   # type: ignore[attr-defined]
                        got = _digest(s)
                        if got != self._sha[t][key]:
                            raise IllegalState(f"simulated region {t!r} came back corrupted", pid=self.dev.pid)
                    else:
                        s.fill_(0)                                    # type: ignore[attr-defined]

    def prepin(self, tags: Sequence[str] | None = None, background: bool = False) -> None:
        """Allocate the retained host backups now (the first pause would otherwise); ``background`` is
        accepted and changes nothing (the clones take no time worth overlapping)."""
        with self._mu:
            todo = [(t, key, s) for t in (self.tags if tags is None else tags) if self.tags[t] == "offload"
                    for key, s in self._storages[t].items() if key not in self._host[t]]
            if todo and self._admit is not None:
                self._admit(sum(s.nbytes() for _, _, s in todo))
            for t, key, s in todo:
                self._host[t][key] = s.clone()                            # type: ignore[attr-defined]

    def close(self) -> None:
        """Give the device memory back (the job is done with it: call it inside its last hold)."""
        with self._mu:
            self._closed = True
            self.dev.close()
