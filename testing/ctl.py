"""The harness's etcd errors and etcdctl; finding binaries and the environment come from the launcher."""
from __future__ import annotations

import os
import shutil
import subprocess

from timeslice.common.server.netutil import http_json
from timeslice.launcher.etcd import ETCD_BIN_ENV, PortTaken
from timeslice.launcher.etcd import etcd_env as clean_env

__all__ = ["ETCDCTL_BIN_ENV", "ETCD_BIN_ENV", "EtcdHarnessError", "PortCollision", "clean_env", "etcdctl_run",
           "find_binary", "http_json"]

ETCDCTL_BIN_ENV = "TIMESLICE_ETCDCTL_BIN"


class EtcdHarnessError(RuntimeError):
    """The test harness could not start, reach or drive etcd."""


class PortCollision(EtcdHarnessError, PortTaken):
    """A member could not bind its port: someone took it after we picked it."""


def find_binary(name: str, env_var: str) -> str:
    """The path of ``name`` from ``env_var``, else next to etcd, else on PATH."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    if name != "etcd" and os.environ.get(ETCD_BIN_ENV):
        sibling = os.path.join(os.path.dirname(os.environ[ETCD_BIN_ENV]), name)
        if os.access(sibling, os.X_OK):
            return sibling
    found = shutil.which(name)
    if not found:
        raise EtcdHarnessError(f"{name} not found: put it on PATH or set {env_var}")
    return found


def etcdctl_run(endpoints: list[str], args: list[str], timeout: float) -> str:
    """Run ``etcdctl`` v3 with ``args``; return stdout or raise with stderr."""
    argv = [find_binary("etcdctl", ETCDCTL_BIN_ENV), f"--endpoints={','.join(endpoints)}",
            "--dial-timeout=2s", f"--command-timeout={timeout}s", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5,
                              env=clean_env(ETCDCTL_API="3"), check=False)
    except subprocess.TimeoutExpired as e:
        raise EtcdHarnessError(f"etcdctl {' '.join(args)} timed out") from e
    if done.returncode != 0:
        raise EtcdHarnessError(
            f"etcdctl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout
