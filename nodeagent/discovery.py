"""Finding the processes of a job on this node.

Two sources:

1. **Registration.** A worker registers itself through the client library
   (``/timeslice/jobs/<job>/workers/<node>/<pid>``). ``local_registered_pids``
   turns those entries into the live local pids, dropping other nodes' entries,
   dead pids, and pids reused by another process (when the entry carries the
   worker's start time).
2. **Kubernetes.** NVML lists the pids that hold GPU memory; each pid's
   ``/proc/<pid>/cgroup`` names its pod. ``pod_gpu_pids`` keeps those of one pod.

Cgroup paths come in two spellings of the pod UID, under either cgroup
version, and both are handled:

    cgroupfs driver:  /kubepods/burstable/pod0b6c5f2e-3c1a-4c5e-9d2f-1a2b3c4d5e6f/<container id>
    systemd driver:   /kubepods.slice/kubepods-burstable.slice/
                      kubepods-burstable-pod0b6c5f2e_3c1a_4c5e_9d2f_1a2b3c4d5e6f.slice/cri-containerd-<id>.scope

(cgroup v1 files have one ``N:controllers:path`` line per hierarchy, v2 a
single ``0::path`` line). Static pods use their config hash, 32 hex digits
without dashes, as UID. ``proc_root`` is a parameter so tests use fixtures.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from timeslice.common import procfs

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# "pod<uid>" as a whole path segment (cgroupfs) or at the end of a
# "<prefix>-pod<uid>.slice" segment (systemd: kubepods-burstable-pod..., or
# kubelet-kubepods-burstable-pod... when the kubelet runs in its own slice, as in kind).
_POD_RE = re.compile(rf"(?:^|/)(?:[a-z][a-z-]*-)?pod({_UID})(?:\.slice)?(?=/|$)", re.IGNORECASE)


def parse_pod_uid(cgroup_text: str) -> str | None:
    """The Kubernetes pod UID in a ``/proc/<pid>/cgroup`` file, normalised to dashed lower case.

    Only paths under a ``kubepods`` hierarchy count, so that a systemd unit that
    happens to be called "pod..." is not mistaken for a pod.
    """
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or "kubepods" not in parts[2]:
            continue
        m = _POD_RE.search(parts[2])
        if m:
            return normalise_uid(m.group(1))
    return None


def normalise_uid(uid: str) -> str:
    return uid.replace("_", "-").lower()


def pod_uid_of(pid: int, proc_root: str | os.PathLike = procfs.PROC_ROOT) -> str | None:
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    return parse_pod_uid(text)


def pod_gpu_pids(pod_uid: str, gpu_pids: Iterable[int],
                 proc_root: str | os.PathLike = procfs.PROC_ROOT) -> list[int]:
    """The pids among ``gpu_pids`` (e.g. ``Nvml.compute_pids()``) that belong to ``pod_uid``."""
    want = normalise_uid(pod_uid)
    return sorted(p for p in set(gpu_pids) if pod_uid_of(p, proc_root) == want)


def local_registered_pids(entries: Iterable[Mapping], node: str,
                          proc_root: str | os.PathLike = procfs.PROC_ROOT) -> list[int]:
    """Live local pids from registration entries ``{"pid", "node"[, "start_time"]}``.

    Entries of other nodes are ignored; a pid that is gone, or whose start time
    differs from the one registered (the pid was reused), is dropped.
    """
    out = set()
    for ent in entries:
        if ent.get("node") != node:
            continue
        try:
            pid = int(ent["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        started = ent.get("start_time")
        if procfs.same_process(pid, int(started) if started is not None else None, proc_root):
            out.add(pid)
    return sorted(out)
