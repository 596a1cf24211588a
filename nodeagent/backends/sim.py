"""SIMULATED GPU backend: the checkpoint state machine over ``nodeagent.sim``'s device.

For machines without a GPU. It is a simulator, it says so in its name
(``sim``) and in every log line, and it keeps the semantics that matter:

* ``lock`` marks the process locked, then takes the process's device lock
  exclusively, which waits for its in-flight device operations to finish; if
  they do not finish within the timeout the mark is undone and ``LockTimeout``
  raised, with the process still running (as CUDA answers NOT_READY);
* ``checkpoint`` copies the arena to a host file, checksumming it, records
  size and sha256 in the state file, and only *then* frees the arena and
  returns its capacity to the ledger (never release what is not safely copied);
* ``restore`` reserves capacity, copies back, verifies the checksum; like the
  driver we measured, a restore that fails for lack of device memory loses the
  context: later restores fail (``lose_context_on_failed_restore``);
* copies are paced to a configurable bandwidth, default the H200 figures of
  the README's "Node agent on an H200" table (env ``TIMESLICE_SIM_CHECKPOINT_GBPS`` / ``..._RESTORE_GBPS``;
  0 = as fast as memory allows).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time
from typing import overload

import structlog

from timeslice.common import device_errors as e
from timeslice.common.sim.device import CHECKPOINTED, LOCKED, RUNNING, SimDevice, device_id
from timeslice.nodeagent.backends.base import Backend, ProcState
from timeslice.nodeagent.sim.meter import SimMeter

log = structlog.get_logger(__name__)

ENV_CKPT_GBPS = "TIMESLICE_SIM_CHECKPOINT_GBPS"
ENV_RESTORE_GBPS = "TIMESLICE_SIM_RESTORE_GBPS"
DEFAULT_CKPT_GBPS = 1.8     # one process, H200, measured (README: "Node agent on an H200")
DEFAULT_RESTORE_GBPS = 4.4
CHUNK = 8 << 20


def _gbps(env: str, given: float | None, default: float) -> float:
    if given is not None:
        return given
    raw = os.environ.get(env)
    return float(raw) if raw else default


class SimBackend(Backend):
    name = "sim"

    def __init__(self, sim_dir=None, host_dir=None, capacity_bytes: int | None = None,
                 checkpoint_gbps: float | None = None, restore_gbps: float | None = None,
                 lose_context_on_failed_restore: bool = True, proc_root: str = "/proc", gpus: int | None = None):
        self.dev = SimDevice(sim_dir, host_dir, capacity_bytes, proc_root, gpus)
        self.meter = SimMeter(self.dev)
        self.checkpoint_bps = _gbps(ENV_CKPT_GBPS, checkpoint_gbps, DEFAULT_CKPT_GBPS) * 1e9
        self.restore_bps = _gbps(ENV_RESTORE_GBPS, restore_gbps, DEFAULT_RESTORE_GBPS) * 1e9
        self.lose_context = lose_context_on_failed_restore

    def describe(self) -> dict:
        return {**super().describe(), "simulated": True, "sim_dir": str(self.dev.root),
                "host_dir": str(self.dev.host_dir), "capacity_bytes": self.dev.capacity, "gpus": self.dev.gpus}

    # -- helpers -------------------------------------------------------------
    def _doc(self, pid: int, op: str) -> dict:
        """The live process's state doc; ProcessGone / NoCudaContext otherwise."""
        if self.dev.is_dead(pid):
            self.dev.forget(pid)
            raise e.ProcessGone(f"{op} pid {pid}: no such process", pid=pid)
        doc = self.dev.read_state(pid)
        if doc is None:
            raise e.NoCudaContext(f"{op} pid {pid}: not registered on the simulated device",
                                  pid=pid, cu_result=3, cu_name="CUDA_ERROR_NOT_INITIALIZED")
        return doc

    def _expect(self, doc: dict, want: str, op: str) -> None:
        if doc["state"] != want:
            raise e.IllegalState(f"{op} pid {doc['pid']}: process is {doc['state']}, must be {want}",
                                 pid=doc["pid"], cu_result=401, cu_name="CUDA_ERROR_ILLEGAL_STATE")

    @overload
    def _exclusive(self, pid: int, timeout_ms: None) -> int: ...      # no timeout: always the fd
    @overload
    def _exclusive(self, pid: int, timeout_ms: int) -> int | None: ...
    def _exclusive(self, pid: int, timeout_ms: int | None) -> int | None:
        """Take the device lock exclusively; the fd (close it to release), or None on timeout."""
        fd = os.open(self.dev.devlock(pid), os.O_RDONLY)
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.0005)

    @staticmethod
    def _copy(src: str, dst_fd: int, nbytes: int, bps: float) -> str:
        """Copy ``nbytes`` from ``src`` into ``dst_fd`` at most at ``bps``; the sha256 of what was copied."""
        h = hashlib.sha256()
        t0 = time.monotonic()
        done = 0
        with open(src, "rb", buffering=0) as f:
            while done < nbytes:
                chunk = f.read(min(CHUNK, nbytes - done))
                if not chunk:
                    raise e.SnapshotCorrupted(f"{src} ended after {done} of {nbytes} bytes")
                h.update(chunk)
                os.write(dst_fd, chunk)
                done += len(chunk)
                if bps > 0:  # pace: never ahead of the emulated link
                    ahead = done / bps - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        return h.hexdigest()

    # -- the state machine ----------------------------------------------------
    def get_state(self, pid: int) -> ProcState:
        try:
            doc = self._doc(pid, "get_state")
        except e.ProcessGone:
            return ProcState.GONE
        except e.NoCudaContext:
            return ProcState.NO_CUDA
        if doc["state"] == CHECKPOINTED and self.dev.held(pid):
            # An agent died between recording the host copy and freeing the
            # device: the copy is complete, so finish the release now. Only
            # under the device lock: a checkpoint or restore in progress holds
            # it (a restore reserves the device while still CHECKPOINTED), and
            # must not have its memory freed under it.
            fd = self._exclusive(pid, 0)
            if fd is not None:
                try:
                    doc = self.dev.read_state(pid) or doc
                    if doc["state"] == CHECKPOINTED and self.dev.held(pid):
                        os.truncate(self.dev.arena(pid), 0)
                        self.dev.ledger.release(pid)
                finally:
                    os.close(fd)
        return ProcState(doc["state"])

    def lock(self, pid: int, timeout_ms: int) -> None:
        doc = self._doc(pid, "lock")
        self._expect(doc, RUNNING, "lock")
        # Mark first: from now on the worker's new device operations wait. Then
        # the exclusive lock waits for the ones already running to finish.
        self.dev.write_state(pid, {**doc, "state": LOCKED})
        fd = self._exclusive(pid, timeout_ms)
        if fd is None:
            self.dev.write_state(pid, {**doc, "state": RUNNING})
            raise e.LockTimeout(f"lock pid {pid}: device still busy after {timeout_ms} ms (simulated NOT_READY)",
                                pid=pid, cu_result=600, cu_name="CUDA_ERROR_NOT_READY")
        os.close(fd)
        log.info("sim_locked", pid=pid, simulated=True)

    def checkpoint(self, pid: int) -> int:
        doc = self._doc(pid, "checkpoint")
        self._expect(doc, LOCKED, "checkpoint")
        nbytes = self.dev.held(pid)
        fd = self._exclusive(pid, None)  # no worker op can be running; hold it anyway while copying
        try:
            tmp = self.dev.host_copy(pid).with_suffix(".partial")
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    sha = self._copy(str(self.dev.arena(pid)), out, nbytes, self.checkpoint_bps) if nbytes else \
                        hashlib.sha256().hexdigest()
                    os.fsync(out)
                finally:
                    os.close(out)
            except BaseException:
                tmp.unlink(missing_ok=True)          # a half copy is no snapshot: the device keeps the bytes
                raise
            os.replace(tmp, self.dev.host_copy(pid))
            # The host copy is complete and named: record it, and only then free the device.
            self.dev.write_state(pid, {**doc, "state": CHECKPOINTED, "bytes": nbytes, "sha256": sha, "lost": False})
            if nbytes:
                os.truncate(self.dev.arena(pid), 0)
            self.dev.ledger.release(pid)
        finally:
            os.close(fd)
        log.info("sim_checkpointed", pid=pid, bytes=nbytes, simulated=True)
        return nbytes

    def restore(self, pid: int) -> int:
        doc = self._doc(pid, "restore")
        self._expect(doc, CHECKPOINTED, "restore")
        if doc.get("lost"):
            raise e.ContextLost(f"restore pid {pid}: context lost by an earlier failed restore (simulated)",
                                pid=pid, cu_result=304, cu_name="CUDA_ERROR_OPERATING_SYSTEM")
        nbytes = int(doc["bytes"])
        # Device lock first, then the reservation: get_state's repair must never
        # see this restore's reservation without the lock that protects it.
        fd = self._exclusive(pid, None)
        try:
            try:
                # Back onto the GPU it was checkpointed from, as a CUDA restore does.
                self.dev.ledger.reserve(pid, nbytes, self.dev.is_dead, int(doc.get("gpu", 0)))
            except e.DeviceOutOfMemory:
                if self.lose_context:
                    self.dev.write_state(pid, {**doc, "lost": True})
                raise
            arena = os.open(self.dev.arena(pid), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.ftruncate(arena, 0)
                sha = self._copy(str(self.dev.host_copy(pid)), arena, nbytes, self.restore_bps) if nbytes else \
                    hashlib.sha256().hexdigest()
            finally:
                os.close(arena)
            if sha != doc["sha256"]:
                # Keep the host copy and the CHECKPOINTED state; give the device back.
                os.truncate(self.dev.arena(pid), 0)
                self.dev.ledger.release(pid)
                raise e.SnapshotCorrupted(f"restore pid {pid}: host copy sha256 {sha} != recorded {doc['sha256']}",
                                          pid=pid)
            self.dev.write_state(pid, {**doc, "state": LOCKED})
            self.dev.host_copy(pid).unlink(missing_ok=True)
        finally:
            os.close(fd)
        log.info("sim_restored", pid=pid, bytes=nbytes, simulated=True)
        return nbytes

    def unlock(self, pid: int) -> None:
        doc = self._doc(pid, "unlock")
        self._expect(doc, LOCKED, "unlock")
        self.dev.write_state(pid, {**doc, "state": RUNNING})

    def reap(self) -> list[int]:
        """Forget exited workers (their device bytes, host copies and files); returns their pids."""
        dead = self.dev.reap()
        if dead:
            log.info("sim_reaped", pids=dead, simulated=True)
        return dead

    # -- sizes -----------------------------------------------------------------
    def snapshot_usage(self, pid: int):
        doc = self.dev.read_state(pid)
        if doc is None or doc["state"] != CHECKPOINTED or self.dev.is_dead(pid):
            return None
        return {device_id(int(doc.get("gpu", 0))): int(doc["bytes"])}
