"""SIMULATOR: how busy the simulated device is, for the duty-cycle metric in CI.

A worker on the simulated device holds its ``devlock-<pid>`` shared for as
long as a device operation runs (``SimDeviceClient.compute``), as a kernel
occupies a GPU. The fraction of samples in which any worker held one — read
from ``/proc/locks``, without touching the locks — is the device's
utilization, the simulator's counterpart of NVML's ``utilization.gpu``.

Sampling runs in a daemon thread only while someone reads the figure: it
starts at the first ``fraction()`` (a scrape) and stops after a window with no
reader, so idle agents (and tests that build many) cost nothing.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

from timeslice.common.sim.device import DEVICE_ID


class SimUtilization:
    def __init__(self, root: str | os.PathLike, interval_s: float = 0.05, window_s: float = 10.0,
                 locks_path: str = "/proc/locks"):
        self.root, self.interval, self.window, self.locks_path = Path(root), interval_s, window_s, locks_path
        self._samples: collections.deque[tuple[float, bool]] = collections.deque()
        self._mu = threading.Lock()
        self._last_read = 0.0
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        """Is any worker inside a device operation right now?"""
        inodes = set()
        for p in self.root.glob("devlock-*"):
            try:
                inodes.add(os.stat(p).st_ino)
            except FileNotFoundError:
                continue
        if not inodes:
            return False
        try:
            with open(self.locks_path) as f:
                for line in f:
                    parts = line.split()
                    # "1: FLOCK  ADVISORY  READ 1234 fe:00:2146366 0 EOF" (a blocked waiter has "->")
                    if (len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "READ" and parts[2] == "ADVISORY"
                            and int(parts[5].rsplit(":", 1)[1]) in inodes):
                        return True
        except (OSError, ValueError, IndexError):
            return False
        return False

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        b = self.busy()
        with self._mu:
            self._samples.append((now, b))
            while self._samples and self._samples[0][0] < now - self.window:
                self._samples.popleft()

    def _loop(self) -> None:
        while time.monotonic() - self._last_read < self.window:
            self.sample()
            time.sleep(self.interval)
        with self._mu:
            self._thread = None

    def fraction(self) -> dict[str, float]:
        """{device: busy fraction over the last window}; starts sampling if it is not running."""
        self._last_read = time.monotonic()
        with self._mu:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sim-utilization", daemon=True)
                self._thread.start()
            samples = list(self._samples)
        if not samples:
            return {}
        return {DEVICE_ID: sum(b for _, b in samples) / len(samples)}
