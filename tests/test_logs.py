"""timeslice.common.server.logs: JSON for every line, library logs included; no bytes reprs; ready lines."""
from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from timeslice.common.server import logs


@pytest.fixture(autouse=True)
def _restore_logging():
    """configure() is process-wide: put structlog and the root logger back afterwards."""
    was, cfg, root = structlog.is_configured(), structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ctx = structlog.contextvars.get_contextvars()
    identity = dict(logs._identity)
    yield
    logs._identity.clear()
    logs._identity.update(identity)
    # Back to *unconfigured* if it was: the client library logs through structlog only
    # once an application configured it (timeslice/logs.py), never into a test's stdout.
    if was:
        structlog.configure(**cfg)
    else:
        structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**ctx)
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.strip()]


def test_events_carry_identity_and_no_bytes_repr():
    buf = io.StringIO()
    logs.configure("lockd", "info", stream=buf, replica="r7")
    structlog.get_logger("t").info("grant", key=b"/timeslice/groups/g/grant", keys=[b"a", "b"])
    (ev,) = _lines(buf)
    assert ev["replica"] == "r7" and ev["component"] == "lockd"
    assert ev["key"] == "/timeslice/groups/g/grant" and ev["keys"] == ["a", "b"]
    assert "b'" not in buf.getvalue()


def test_events_from_plain_threads_carry_identity_too():
    import threading
    buf = io.StringIO()
    logs.configure("nodeagent", "info", stream=buf, node="n9")
    t = threading.Thread(target=lambda: structlog.get_logger("t").info("from_thread"))
    t.start()
    t.join()
    (ev,) = _lines(buf)
    assert ev["event"] == "from_thread" and ev["node"] == "n9"


def test_stdlib_logging_goes_through_the_json_renderer():
    buf = io.StringIO()
    logs.configure("nodeagent", "info", stream=buf, node="n1")
    logging.getLogger("grpc._cython").warning("channel %s broke", "x")
    logging.getLogger("aetcd").info("below warning: dropped")
    (ev,) = _lines(buf)
    assert ev["event"] == "library_log" and ev["message"] == "channel x broke"
    assert ev["logger"] == "grpc._cython" and ev["node"] == "n1" and ev["level"] == "warning"


def test_ready_line_is_json_and_parses_in_both_forms():
    buf = io.StringIO()
    logs.configure("lockd", "info", stream=io.StringIO(), replica="r0")
    line = logs.ready("LOCKD_READY", stream=buf, port=4242, metrics_port=9464)
    doc = json.loads(buf.getvalue())
    assert doc["event"] == "lockd_ready" and doc["port"] == 4242 and doc["replica"] == "r0"
    assert logs.parse_ready(line, "LOCKD_READY")["port"] == "4242"
    assert logs.parse_ready(line.encode(), "NODEAGENT_READY") is None
    assert logs.parse_ready(b"LOCKD_READY port=7 replica=r1\n", "LOCKD_READY") == {"port": "7", "replica": "r1"}
    assert logs.parse_ready("{not json", "LOCKD_READY") is None


def test_every_logger_is_named_by_its_module():
    """Loggers are ``__name__``-based, all under ``timeslice``: configuring that logger reaches every part."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    calls = []
    for folder in ("client", "common", "testing", "launcher", "lockd", "nodeagent"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "get_logger"
                        and node.args):
                    calls.append((path.relative_to(root).as_posix(), ast.unparse(node.args[0])))
    assert len(calls) > 20
    assert [c for c in calls if c[1] not in ("__name__", "self.name")] == []
