"""Exclusion enforced at the device: freeze the processes of a job that lost its session while on a GPU.

A lease lock cannot stop a holder that was paused past its lease (a GC pause, a frozen
VM, SIGSTOP) from running once it wakes: it still believes it holds the group, and the
GPU checks no fencing token. When the next grant is elided (both jobs fit), nothing
would stop the stale holder's kernels from running beside the new holder's.

So the agent watches the jobs it has seen on its devices. When a job's registrations
vanish because its session lease *expired* (not a deliberate unregister or CloseSession,
which leaves a marker first: ``Keys.closed``) while its processes live
on with a device context, the agent *freezes* them with the checkpoint backend's
process lock (the driver's lock, ~0.5 ms: every CUDA call of the process waits; on the
simulator, every device operation). A frozen process runs nothing on the GPU until its
job registers it again (a new session: the client re-registers its workers), which
thaws it, or until it exits. The leader does not grant past such a job until the
agent's report shows it gone from the running jobs (frozen or exited): see
``lockd.plan`` (``unfenced``).

The decision is sans-IO (``Orphans.step``): registrations and process states in,
pids to freeze and to thaw out. ``DeviceExclusion`` (nodeagent/exclusion.py) applies them.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ON_DEVICE = "on_device"      # running with a device context: could run kernels
OFF_DEVICE = "off_device"    # no context, checkpointed, paused or locked already
GONE = "gone"


@dataclass
class Step:
    freeze: dict[int, str] = field(default_factory=dict)     # pid -> job
    thaw: dict[int, str] = field(default_factory=dict)
    forgotten: list[int] = field(default_factory=list)


class Orphans:
    def __init__(self) -> None:
        self.seen: dict[int, str] = {}       # pid -> job: registered and on a device, last time we looked
        self.frozen: dict[int, str] = {}     # pid -> job whose session went while the pid was on a device

    def step(self, registered: Mapping[int, str], state: Callable[[int], str],
             deliberate: Callable[[str], bool] = lambda job: False) -> Step:
        """``registered``: pid -> job of the trusted registrations now; ``state(pid)``: ON_DEVICE,
        OFF_DEVICE or GONE; ``deliberate(job)``: the job let its registrations go itself (its
        session is still there, or CloseSession left its marker): nothing to freeze.
        Returns what to do; ``record`` must be told what was done."""
        out = Step()
        for pid, job in registered.items():
            if self.frozen.get(pid) == job:
                out.thaw[pid] = job          # its job is back (a new session re-registered it)
        for pid, job in list(self.seen.items()):
            if pid in registered:
                continue
            del self.seen[pid]               # its registration went
            if not deliberate(job) and state(pid) == ON_DEVICE:
                out.freeze[pid] = job
        for pid in list(self.frozen):
            if pid not in out.thaw and state(pid) == GONE:
                out.forgotten.append(pid)
                del self.frozen[pid]
        for pid, job in registered.items():
            if pid not in out.thaw and state(pid) == ON_DEVICE:
                self.seen[pid] = job
        return out

    def record(self, frozen: Mapping[int, str], thawed: Mapping[int, str]) -> None:
        self.frozen.update(frozen)
        for pid in thawed:
            self.frozen.pop(pid, None)

    def frozen_jobs(self) -> list[str]:
        return sorted(set(self.frozen.values()))

    # -- a job frozen on purpose (a strict group's elided handoff) that leaves --------------
    @staticmethod
    def leaving(frozen: Mapping[str, list[int]], registered: Mapping[int, str],
                deliberate: Callable[[str], bool]) -> dict[int, str]:
        """Pids to thaw because their job let them go on purpose while a freeze intent held them.

        ``frozen``: job -> pids its status says a freeze intent froze. A job that unregisters a
        worker, or closes its session, is leaving: on the real driver a process exiting with
        its CUDA context locked would wait on it, so its lock is lifted (the agent acts only on
        registered workers from then on). A session that *expired* is no deliberate leave: those
        processes stay frozen, like any orphan's.
        """
        return {pid: job for job, pids in frozen.items() if deliberate(job)
                for pid in pids if registered.get(pid) != job}

    # -- durable across agent restarts (the frozen processes outlive the agent) --------------
    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(p): j for p, j in self.frozen.items()}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Orphans:
        o = cls()
        try:
            o.frozen = {int(p): str(j) for p, j in json.loads(path.read_text()).items()}
        except (FileNotFoundError, ValueError, AttributeError):
            pass
        return o
