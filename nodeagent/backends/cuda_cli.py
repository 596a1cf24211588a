"""The ``cuda-checkpoint`` command-line backend, for images that ship NVIDIA's tool.

The tool's documented command line (r570 and later):

    cuda-checkpoint --get-state --pid P                 prints running|locked|checkpointed|failed
    cuda-checkpoint --action lock --pid P [--timeout MS]
    cuda-checkpoint --action checkpoint|restore|unlock --pid P

A non-zero exit is a failure; the driver's result is recovered from the text
the tool prints (its ``CUDA_ERROR_*`` name or the driver's description of it,
see ``curesult.code_from_text``) so that both backends raise the same typed
errors. One process per call costs a few milliseconds of fork/exec, next to
checkpoints that take seconds.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from timeslice.common import device_errors as e
from timeslice.nodeagent.backends import curesult
from timeslice.nodeagent.backends.base import DeviceMeter, ProcState
from timeslice.nodeagent.backends.cuda_common import CudaCheckpointBackend
from timeslice.nodeagent.backends.records import SnapshotRecords

BINARY = "cuda-checkpoint"
ENV_BINARY = "TIMESLICE_CUDA_CHECKPOINT"  # path to the tool, when it is not on PATH as cuda-checkpoint
# Slack beyond the lock's own timeout before the tool itself is declared hung.
LOCK_SLACK_S = 30.0
_STATES = {"running": ProcState.RUNNING, "locked": ProcState.LOCKED,
           "checkpointed": ProcState.CHECKPOINTED, "failed": ProcState.FAILED}


def find_binary() -> str | None:
    env = os.environ.get(ENV_BINARY)
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which(BINARY)


class CudaCliBackend(CudaCheckpointBackend):
    name = "cuda-cli"

    def __init__(self, binary: str | None = None, meter: DeviceMeter | None = None,
                 records: SnapshotRecords | None = None, proc_root: str = "/proc",
                 call_timeout_s: float | None = None):
        """``call_timeout_s`` bounds checkpoint/restore/get-state calls; None waits as long as
        the copy takes (a 140 GB context needs over a minute)."""
        path = binary or find_binary()
        if not path:
            raise e.BackendUnavailable(f"{BINARY} not found on PATH (or ${ENV_BINARY})")
        if meter is None:
            from timeslice.nodeagent.backends.nvml import NvmlMeter
            meter = NvmlMeter()
        super().__init__(meter, records or SnapshotRecords(proc_root=proc_root), proc_root)
        self.binary = path
        self.call_timeout_s = call_timeout_s

    def describe(self) -> dict:
        return {**super().describe(), "binary": self.binary}

    def _run(self, op: str, pid: int, args: list[str], timeout_s: float | None) -> str:
        cmd = [self.binary, *args, "--pid", str(pid)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise e.BackendError(f"{op} pid {pid}: {BINARY} did not answer within {timeout_s} s",
                                 pid=pid) from exc
        except OSError as exc:
            raise e.BackendUnavailable(f"{op} pid {pid}: cannot run {self.binary}: {exc}", pid=pid) from exc
        if proc.returncode != 0:
            text = " ".join((proc.stderr + " " + proc.stdout).split())
            code = curesult.code_from_text(text)
            if code is None:
                raise e.BackendError(f"{op} pid {pid}: {BINARY} exited {proc.returncode}: {text}", pid=pid)
            raise curesult.error_for(code, op, pid, text)
        return proc.stdout

    def _state(self, pid: int) -> ProcState:
        out = self._run("get_state", pid, ["--get-state"], self.call_timeout_s).strip().lower()
        return _STATES.get(out.split()[-1] if out else "", ProcState.UNKNOWN)

    def _lock(self, pid: int, timeout_ms: int) -> None:
        self._run("lock", pid, ["--action", "lock", "--timeout", str(timeout_ms)], timeout_ms / 1000 + LOCK_SLACK_S)

    def _checkpoint(self, pid: int) -> None:
        self._run("checkpoint", pid, ["--action", "checkpoint"], self.call_timeout_s)

    def _restore(self, pid: int) -> None:
        self._run("restore", pid, ["--action", "restore"], self.call_timeout_s)

    def _unlock(self, pid: int) -> None:
        self._run("unlock", pid, ["--action", "unlock"], self.call_timeout_s)
