"""Finding and talking to the etcd binaries: paths, environment, etcdctl, HTTP probes.

Kept apart from the process management so that each piece stays small.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

ETCD_BIN_ENV = "TIMESLICE_ETCD_BIN"
ETCDCTL_BIN_ENV = "TIMESLICE_ETCDCTL_BIN"
from timeslice.common.netutil import http_json  # noqa: E402,F401 - re-exported for the harness


class EtcdHarnessError(RuntimeError):
    """The test harness could not start, reach or drive etcd."""


class PortCollision(EtcdHarnessError):
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


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment minus ETCD_*/ETCDCTL_* variables.

    etcd and etcdctl read every flag from the environment too, and refuse to start
    when a variable and a flag both set one, so a developer's shell settings
    would otherwise break or silently redirect the tests.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ETCD_", "ETCDCTL_"))}
    env.update(extra)
    return env


def etcdctl_run(endpoints: list[str], args: list[str], timeout: float) -> str:
    """Run ``etcdctl`` v3 with ``args``; return stdout or raise with stderr."""
    argv = [find_binary("etcdctl", ETCDCTL_BIN_ENV), f"--endpoints={','.join(endpoints)}",
            "--dial-timeout=2s", f"--command-timeout={timeout}s", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5,
                              env=clean_env(ETCDCTL_API="3"))
    except subprocess.TimeoutExpired as e:
        raise EtcdHarnessError(f"etcdctl {' '.join(args)} timed out") from e
    if done.returncode != 0:
        raise EtcdHarnessError(
            f"etcdctl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


