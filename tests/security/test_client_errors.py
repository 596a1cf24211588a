"""The client's error table covers every status lockd can send, with hints that are true.

First the table itself, against every error class the servers define (walked as
tests/security/test_status_codes.py walks them) and the statuses gRPC and the gates
send of their own; then the public client against a real lockd: a missing admin token,
another job's pid, a session limit — each the exception that says what happened.
"""
from __future__ import annotations

import importlib
import pkgutil

import grpc
import pytest

import timeslice.common
import timeslice.lockd
from tests.security.conftest import NODE, MiB
from tests.security.test_session_limits import lockd_with  # noqa: F401  (the fixture)
from timeslice import AsyncOrchestratorClient
from timeslice import errors as E
from timeslice.common.errors import TimesliceError

#: What a status may honestly be for a client: INTERNAL-like codes stay InternalError.
OPAQUE = {"INTERNAL", "UNKNOWN", "DATA_LOSS"}


def _server_codes() -> set[str]:
    for pkg in (timeslice.lockd, timeslice.common):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith(("cli", "__main__")):
                importlib.import_module(m.name)
    out, todo = set(), [TimesliceError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith(("timeslice.lockd", "timeslice.common")):
            out.add(cls.code)
    # The gate's and gRPC's own: an admin call refused, an unknown method, a message too large.
    return out | {"UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "UNKNOWN"}


@pytest.mark.parametrize("method", ["OpenSession", "Acquire", "Yield", "RegisterWorker", "CreateGroup",
                                    "ListGroups", "WatchGroup"])
def test_every_status_the_server_sends_has_its_own_exception(method):
    for code in sorted(_server_codes()):
        cls = E.error_class(code, "x", method)
        assert cls is not E.TimesliceClientError, code
        if code in OPAQUE:
            assert cls is E.InternalError
        else:
            assert cls is not E.InternalError, (code, method)
            assert cls.code == code, (code, cls)


@pytest.mark.parametrize("code,details,method,cls,untrue", [
    ("PERMISSION_DENIED", "pid 7 on node 'n' is a registered worker of another job", "RegisterWorker",
     E.PermissionDeniedError, "retrying may help"),
    ("PERMISSION_DENIED", "admin calls are disabled: this server has no admin token", "CreateGroup",
     E.PermissionDeniedError, "retrying may help"),
    ("RESOURCE_EXHAUSTED", "limit max_sessions_per_peer: ipv4:10.0.0.1 has 64 live sessions", "OpenSession",
     E.LimitExceededError, "node agents"),
    ("RESOURCE_EXHAUSTED", "limit max_watches_per_caller: ipv4:10.0.0.1 has 64 open", "WatchGroup",
     E.LimitExceededError, "node agents"),
    ("RESOURCE_EXHAUSTED", "limit max_workers_per_job: job 'j' has 256", "RegisterWorker",
     E.LimitExceededError, "node agents"),
    ("RESOURCE_EXHAUSTED", "etcdserver: mvcc: database space exceeded", "CreateGroup",
     E.ResourceExhaustedError, "node agents"),
    ("RESOURCE_EXHAUSTED", "snapshot of job a on node n1 failed", "Acquire", E.SwapFailedError, "limit"),
    ("UNAUTHENTICATED", "admin call without credentials: send 'authorization: Bearer <token>'", "CreateGroup",
     E.CredentialsError, "session is lost"),
    ("UNAUTHENTICATED", "read call without credentials", "ListGroups", E.CredentialsError, "session is lost"),
    ("UNAUTHENTICATED", "session secret does not match", "Yield", E.AuthError, "TIMESLICE_ADMIN_TOKEN"),
    ("UNIMPLEMENTED", "Method not found!", "WatchGroup", E.UnimplementedError, "retrying may help"),
])
def test_each_exception_tells_the_truth(code, details, method, cls, untrue):
    err = E.from_status(code, details, method)
    assert type(err) is cls, type(err)
    assert untrue not in str(err), str(err)
    assert details in str(err) and cls.hint in str(err)


@pytest.fixture
async def client(stack):
    c = AsyncOrchestratorClient(target=stack.target, job_id="errs-job", timeout=10)
    yield c
    await c.close()


async def test_the_client_says_what_lockd_refused(stack, client, jobs, workers, monkeypatch):
    monkeypatch.delenv("TIMESLICE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("TIMESLICE_ADMIN_TOKEN_FILE", raising=False)
    with pytest.raises(E.CredentialsError) as missing:
        await client.create_group("errs-g", nodes=[NODE])
    assert "session" not in str(missing.value).split(" — ")[-1]
    owner = await jobs("owner")
    w = workers(1 * MiB, seed=11)
    await owner.register(NODE, w.pid)
    with pytest.raises(E.PermissionDeniedError):
        await client.register_worker(pid=w.pid, node=NODE)


async def test_a_limit_is_a_limit_not_a_failed_swap(lockd_with):  # noqa: F811
    _prefix, port = lockd_with("--max-sessions", "10", "--max-sessions-per-peer", "1")
    first = AsyncOrchestratorClient(target=f"127.0.0.1:{port}", job_id="lim-a", timeout=10)
    second = AsyncOrchestratorClient(target=f"127.0.0.1:{port}", job_id="lim-b", timeout=10)
    try:
        with pytest.raises(E.UnknownGroupError):
            await first.acquire("no-such-group", timeout=5)        # opens first's session, then NOT_FOUND
        with pytest.raises(E.LimitExceededError) as e:
            await second.acquire("no-such-group", timeout=5)       # second's session is past the limit
        assert "max_sessions_per_peer" in str(e.value) and "node agents" not in str(e.value)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED.name
    finally:
        await first.close()
        await second.close()
