"""The CLI never surprises: each surprise a newcomer met, as a test.

One detached local cluster (``timeslice up --detach --json``) serves the module;
the per-user state folder is the module's own (``TIMESLICE_USER_STATE_DIR``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from timeslice import OrchestratorClient, __version__, cli
from timeslice.launcher.cli_up import summary
from timeslice.launcher.cluster import LocalCluster

PY = sys.executable


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "TIMESLICE_USER_STATE_DIR": str(base / "user-state")}
    e.pop("TIMESLICE_TARGET", None)
    return e


def ts(env, *args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "timeslice.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def up(env, tmp_path_factory):
    """The JSON that `up --detach --json` printed; the cluster is stopped (with --json) at the end."""
    run_dir = tmp_path_factory.mktemp("run")
    logs = tmp_path_factory.mktemp("logs")
    r = ts(env, "up", "--detach", "--json", "--run-dir", str(run_dir / "c1"), "--log-dir", str(logs),
           "--backend", "sim", "--lockd-replicas", "1", "--node", "cli-node", "--group", "cli-g")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)            # one JSON object on stdout, progress on stderr
    yield doc
    # No --run-dir: the running cluster is found through the per-user pointer, from elsewhere.
    stop = ts(env, "up", "--stop", "--json", cwd=str(logs))
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout) == {"stopped": True, "run_dir": doc["run_dir"], "state_file": doc["state_file"]}
    again = ts(env, "up", "--stop", "--json")
    assert again.returncode == 1 and json.loads(again.stdout)["stopped"] is False


def test_up_detach_json_names_addresses_and_metrics_ports(up):
    assert up["target"] and up["detached"] is True and up["node"] == "cli-node"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", up["metrics"]["nodeagent"])
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", m) for m in up["metrics"]["lockd"])
    assert up["pids"] and Path(up["state_file"]).is_file()


def test_human_summary_prints_the_agent_metrics_port(up):
    c = LocalCluster.from_state(json.loads(Path(up["state_file"]).read_text()), progress=lambda _m: None)
    text = summary(c, 0.0)
    assert f"nodeagent {up['metrics']['nodeagent']}" in text


def test_local_cluster_is_found_from_any_directory(env, up, tmp_path):
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    r = ts(env, "status", "cli-g", "--json", "--timeout", "5", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["group_id"] == "cli-g"


def test_second_up_refuses_and_says_what_to_do(env, up, tmp_path):
    r = ts(env, "up", "--detach", "--run-dir", str(tmp_path / "c2"), "--backend", "sim")
    assert r.returncode == 1
    assert "already running" in r.stderr and up["target"] in r.stderr and "--another" in r.stderr
    assert not (tmp_path / "c2").exists(), "nothing may start"
    r = ts(env, "up", "--detach", "--json", "--run-dir", str(tmp_path / "c3"), "--backend", "sim")
    assert r.returncode == 1 and json.loads(r.stdout)["running"]["target"] == up["target"]


def test_connection_refused_fails_fast_naming_the_target(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again: nothing listens there
    # A --timeout far beyond the subprocess limit: only failing fast can finish in time.
    r = ts(env, "--target", f"127.0.0.1:{port}", "status", "g", "--timeout", "300", timeout=30)
    assert r.returncode == 1
    assert f"127.0.0.1:{port}" in r.stderr and "connection refused" in r.stderr


def test_group_over_a_node_without_agent_warns(env, up):
    r = ts(env, "--target", up["target"], "group", "create", "lonely-g", "--node", "no-such-node", "--json")
    assert r.returncode == 0, r.stderr
    assert "no-such-node" in r.stderr and "no live node agent" in r.stderr
    assert json.loads(r.stdout)["warnings"]
    r = ts(env, "--target", up["target"], "group", "create", "fine-g", "--node", "cli-node")
    assert r.returncode == 0 and "warning" not in r.stderr


def test_every_option_shows_its_default_in_help():
    missing = []
    for p in cli._all_parsers(cli.build_parser()):
        fmt = p._get_formatter()
        for a in p._actions:
            if (not a.option_strings or isinstance(a, (argparse._HelpAction, argparse._VersionAction))
                    or a.default in (None, False, [], argparse.SUPPRESS) or a.help == argparse.SUPPRESS):
                continue
            if "default" not in fmt._expand_help(a).lower():
                missing.append(f"{p.prog} {a.option_strings[0]}")
    assert missing == [], missing


def test_watch_redraws_ages_while_nothing_changes(env, up):
    with OrchestratorClient(up["target"], job_id="watch-holder", timeout=20) as c:
        c.acquire("cli-g", timeout=20)
        r = ts(env, "--target", up["target"], "watch", "cli-g", "--frames", "3", "--refresh", "0.2", timeout=60)
        c.yield_("cli-g")
    assert r.returncode == 0, r.stderr
    frames = [f for f in r.stdout.split("--- ") if f.strip()]
    assert len(frames) == 3
    assert all("update 1" in f for f in frames), "no change happened: every frame is a redraw of update 1"
    ages = [float(m.group(1)) for f in frames for m in [re.search(r"granted (\d+\.\d)s ago", f)] if m]
    assert len(ages) == 3 and ages == sorted(ages) and ages[-1] > ages[0]


@pytest.mark.slow
def test_demo_json_is_one_object(env, up, tmp_path):
    r = ts(env, "--json", "demo", "--iterations", "1", "--regimes", "elide", "--generate-s", "0.1",
           "--rewards-s", "0.1", "--train-s", "0.1", "--out", str(tmp_path / "demo"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["summary"] and Path(doc["timeline"]).exists()


@pytest.mark.parametrize("module, program", [("timeslice.cli", "timeslice"), ("timeslice.lockd.cli", "lockd"),
                                             ("timeslice.nodeagent.cli", "nodeagent")])
def test_version_on_every_command(module, program):
    r = subprocess.run([PY, "-m", module, "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.split() == [program, __version__]


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_without_the_server_extra_say_what_to_install(command, monkeypatch, capsys, tmp_path):
    """A plain job-client install has no lockd dependencies: `up`/`demo` say so instead of failing later."""
    from timeslice.launcher import cli_up
    monkeypatch.setattr(cli_up, "SERVER_MODULES", (*cli_up.SERVER_MODULES, "timeslice_no_such_module"))
    monkeypatch.setenv("TIMESLICE_USER_STATE_DIR", str(tmp_path))
    assert cli.main([command, "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"timeslice {command}:" in err and "timeslice_no_such_module" in err and "timeslice[server]" in err
    assert list(tmp_path.iterdir()) == []          # nothing was started or written
