"""Fixtures for client tests: real lockd replicas (processes) on the real etcd.

``lockd`` is one 3-replica cluster per test module (starting one costs about a
second), in a key prefix of its own; tests keep out of each other's way with
``uid``-suffixed group and job ids. Tests that kill replicas use ``lockd_own``,
a cluster of their own in the test's ``key_prefix``.
"""
from __future__ import annotations

import secrets

import pytest

from timeslice.testing.lockd import LockdCluster

# Fast leader election, as the lockd tests use: a killed leader is replaced in ~3 s.
FAST = ["--lease-ttl", "3", "--renew-deadline", "2", "--retry-period", "0.5", "--swap-timeout", "30"]


def _cluster(etcd, prefix: str, logdir: str) -> LockdCluster:
    return LockdCluster(etcd.endpoints_str, prefix, n=3, logdir=logdir, extra=FAST).start()


@pytest.fixture(scope="module")
def lockd(etcd, tmp_path_factory, request):
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    cluster = _cluster(etcd, f"/t-{name}-{secrets.token_hex(4)}/", str(tmp_path_factory.mktemp("lockd")))
    yield cluster
    cluster.stop()


@pytest.fixture
def lockd_own(etcd, key_prefix, tmp_path):
    cluster = _cluster(etcd, key_prefix, str(tmp_path))
    yield cluster
    cluster.stop()


@pytest.fixture
def uid() -> str:
    return secrets.token_hex(3)


@pytest.fixture
def clients():
    """make(OrchestratorClient(...)) registers a client to close at teardown."""
    made = []

    def make(c):
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.close()
        except Exception:
            pass


@pytest.fixture
def admin(lockd, uid, clients):
    """A client whose job is this test's admin (the harness shares the admin token)."""
    from timeslice import OrchestratorClient
    return clients(OrchestratorClient(lockd.targets, job_id=f"admin-{uid}"))


@pytest.fixture
def group(admin, uid):
    """A fresh group of this test over one node."""
    g = f"g-{uid}"
    admin.create_group(g, ["node-x"])
    return g
