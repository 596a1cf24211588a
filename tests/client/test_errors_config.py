"""The status → exception table, and where settings come from (no server needed)."""
from __future__ import annotations

import socket
import sys

import pytest

import timeslice
from tests.client.helpers import FakeCuda, fake_torch
from timeslice import errors as E
from timeslice.common.errors import TimesliceError
from timeslice.common.ids import check_id
from timeslice.config import (
    ClientConfig,
    node_name,
    parse_targets,
    resolve_job_id,
    sanitize_id,
)
from timeslice.hooks import release_framework_cache
from timeslice.model import NodeSpec


@pytest.mark.parametrize("code,details,method,cls", [
    ("FAILED_PRECONDITION", "not_holder: 'j' is waiting for 'g'", "Yield", E.NotHolderError),
    ("FAILED_PRECONDITION", "not_queued: 'j' does not hold 'g'", "Yield", E.NotHolderError),
    ("FAILED_PRECONDITION", "stale_token: token 3 is not 'j''s current token 5", "Yield", E.StaleTokenError),
    ("FAILED_PRECONDITION", "group 'g' has 2 queued job(s)", "DeleteGroup", E.GroupBusyError),
    ("FAILED_PRECONDITION", "something else", "Acquire", E.PreconditionError),
    ("ABORTED", "'j' lost its place in 'g'", "Acquire", E.SessionLostError),
    ("UNAUTHENTICATED", "session secret does not match", "Yield", E.AuthError),
    ("NOT_FOUND", "unknown group 'g'", "Acquire", E.UnknownGroupError),
    ("INVALID_ARGUMENT", "job id 'a/b' is ill-formed", "Acquire", E.InvalidArgumentError),
    ("ALREADY_EXISTS", "job 'j' already has a live session", "OpenSession", E.SessionConflictError),
    ("ALREADY_EXISTS", "group 'g' exists with other nodes", "CreateGroup", E.AlreadyExistsError),
    ("DEADLINE_EXCEEDED", "not granted within 1s", "Acquire", E.AcquireTimeoutError),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", "KeepAlive", E.DeadlineError),
    ("RESOURCE_EXHAUSTED", "snapshot of job a on node n1 failed", "Acquire", E.SwapFailedError),
    ("UNAVAILABLE", "failed to connect", "ListGroups", E.UnavailableError),
    ("CANCELLED", "cancelled", "Acquire", E.CallCancelledError),
    ("DATA_LOSS", "?", "Acquire", E.InternalError),
])
def test_status_to_exception(code, details, method, cls):
    err = E.from_status(code, details, method)
    assert type(err) is cls
    assert isinstance(err, E.TimesliceClientError) and isinstance(err, TimesliceError)
    assert err.code == code and err.method == method and err.details == details
    assert details in str(err)
    if cls.hint:
        assert cls.hint in str(err)      # every message says what to do


def test_reason_prefix_parsing():
    assert E.reason_of("not_holder: x") == "not_holder"
    assert E.reason_of("unknown group 'a:b'") is None
    assert E.reason_of("") is None


def test_every_exception_is_exported_from_the_package():
    for name in dir(E):
        obj = getattr(E, name)
        if isinstance(obj, type) and issubclass(obj, E.TimesliceClientError):
            assert getattr(timeslice, name) is obj


def test_targets(monkeypatch, tmp_path):
    monkeypatch.delenv("TIMESLICE_TARGET", raising=False)
    monkeypatch.setenv("TIMESLICE_USER_STATE_DIR", str(tmp_path / "no-clusters"))   # no `timeslice up` here
    assert parse_targets(None) == ["127.0.0.1:50051"]
    monkeypatch.setenv("TIMESLICE_TARGET", "a:1, b:2,,a:1")
    assert parse_targets(None) == ["a:1", "b:2"]
    assert parse_targets(["x:5", "y"]) == ["x:5", "y:50051"]
    assert parse_targets("dns:///lockd.ns.svc:50051") == ["dns:///lockd.ns.svc:50051"]
    assert parse_targets("lockd-headless") == ["lockd-headless:50051"]
    assert parse_targets("[::1]:7,::1") == ["[::1]:7", "[::1]:50051"]
    with pytest.raises(E.InvalidArgumentError):
        parse_targets("host:port")


def test_job_id_sources(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TIMESLICE_JOB_ID", "from-env")
    assert resolve_job_id("explicit") == ("explicit", False)
    assert resolve_job_id(None) == ("from-env", False)
    monkeypatch.delenv("TIMESLICE_JOB_ID")
    a, gen = resolve_job_id(None)
    b, _ = resolve_job_id(None)
    assert gen and a != b
    check_id("job", a)
    with pytest.raises(E.InvalidArgumentError):
        resolve_job_id("bad/id")


def test_job_id_from_slurm_after_the_explicit_ones(monkeypatch):
    """Inside a Slurm job the id defaults to $SLURM_JOB_ID; the argument and $TIMESLICE_JOB_ID still win."""
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert resolve_job_id(None) == ("4242", False)
    assert ClientConfig.build("h:1", None, session_ttl=10, timeout=5).job_id == "4242"
    monkeypatch.setenv("TIMESLICE_JOB_ID", "from-env")
    assert resolve_job_id(None) == ("from-env", False)
    assert resolve_job_id("explicit") == ("explicit", False)
    monkeypatch.delenv("TIMESLICE_JOB_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "  ")
    assert resolve_job_id(None)[1], "a blank SLURM_JOB_ID is no id"
    monkeypatch.setenv("SLURM_JOB_ID", "bad/id")
    with pytest.raises(E.InvalidArgumentError):
        resolve_job_id(None)


def test_node_name(monkeypatch):
    monkeypatch.setenv("TIMESLICE_NODE_NAME", "gpu-node-7")
    assert node_name() == "gpu-node-7"
    monkeypatch.delenv("TIMESLICE_NODE_NAME")
    check_id("node", node_name())
    monkeypatch.setattr(socket, "gethostname", lambda: "__my host!.example.")
    assert node_name() == "my-host-.example"
    assert sanitize_id("///") == "node"
    assert len(sanitize_id("x" * 300)) == 127


def test_config_validation():
    with pytest.raises(E.InvalidArgumentError):
        ClientConfig.build("h:1", "j", session_ttl=1, timeout=5)
    with pytest.raises(E.InvalidArgumentError):
        ClientConfig.build("h:1", "j", session_ttl=10, timeout=0)
    cfg = ClientConfig.build("h:1", "j", session_ttl=9, timeout=2)
    assert cfg.keepalive_period == 3 and cfg.retry.attempt_timeout == 2


def test_node_spec_parsing():
    assert NodeSpec.parse("n1") == NodeSpec("n1")
    assert NodeSpec.parse("n1:0,2") == NodeSpec("n1", (0, 2))
    assert NodeSpec.coerce(("n2", [1])) == NodeSpec("n2", (1,))
    assert str(NodeSpec("n1", (0, 2))) == "n1:0,2"
    with pytest.raises(ValueError):
        NodeSpec.parse("n1:x")


def test_cache_release_only_when_torch_is_loaded_and_cuda_initialised(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert release_framework_cache() is False
    assert "torch" not in sys.modules                 # never imports torch itself
    calls = []
    fake_torch(monkeypatch, FakeCuda(calls.append, initialized=False))
    assert release_framework_cache() is False and calls == []
    fake_torch(monkeypatch, FakeCuda(calls.append))
    assert release_framework_cache() is True
    assert calls == ["synchronize", "empty_cache"]


def test_generated_job_id_is_logged_as_a_structured_event(monkeypatch):
    import structlog
    from structlog.testing import capture_logs

    from timeslice import OrchestratorClient
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    was_configured = structlog.is_configured()
    try:
        with capture_logs() as events:
            c = OrchestratorClient("127.0.0.1:1")
        c.close()
    finally:
        # capture_logs leaves structlog *configured*; a later test that reads the CLI's stdout
        # would then see the library's events there (test_client_cli's group round trip did,
        # when this file ran first)
        if not was_configured:
            structlog.reset_defaults()
    ev = [e for e in events if e["event"] == "job_id_generated"]
    assert ev and ev[0]["job"] == c.job_id and "TIMESLICE_JOB_ID" in ev[0]["hint"]


def test_without_structlog_setup_events_go_to_stdlib_logging_not_stdout(monkeypatch, caplog, capsys):
    import structlog

    from timeslice import OrchestratorClient
    monkeypatch.setattr(structlog, "is_configured", lambda: False)
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with caplog.at_level("WARNING", logger="timeslice"):
        c = OrchestratorClient("127.0.0.1:1")
    c.close()
    assert any(r.getMessage().startswith("job_id_generated job=") and r.name.startswith("timeslice.")
               for r in caplog.records)
    assert capsys.readouterr().out == ""
