"""The `timeslice` CLI as a user runs it: a subprocess against real replicas."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from timeslice import OrchestratorClient, UnknownGroupError, cli


def run(lockd, *args, check=True):
    env = {**os.environ, "TIMESLICE_TARGET": ",".join(lockd.targets)}
    r = subprocess.run([sys.executable, "-m", "timeslice.cli", *args], env=env, capture_output=True, text=True,
                       timeout=60)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def main(lockd, capsys, *args) -> tuple[int, str, str]:
    """The CLI in-process (for error paths; the user-facing views run as subprocesses)."""
    rc = cli.main(["--target", ",".join(lockd.targets), *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_group_create_groups_status_jobs_delete(lockd, uid, clients, capsys):
    g = f"cli-{uid}"
    r = run(lockd, "group", "create", g, "--node", "n1:0,1", "--node", "n2")
    assert f"group {g} created" in r.stdout and "n1:0,1 n2" in r.stdout

    a = clients(OrchestratorClient(lockd.targets, job_id=f"ja-{uid}"))
    b = clients(OrchestratorClient(lockd.targets, job_id=f"jb-{uid}"))
    ga = a.acquire(g)

    def wait_in_line():
        with contextlib.suppress(UnknownGroupError):      # the test deletes the group under it
            b.acquire(g, timeout=30)
    threading.Thread(target=wait_in_line, daemon=True).start()
    deadline = time.monotonic() + 10
    while not a.status(g).waiters and time.monotonic() < deadline:
        time.sleep(0.02)

    r = run(lockd, "groups")
    row = next(line for line in r.stdout.splitlines() if line.startswith(g))
    assert row.split()[:2] == [g, "n1:0,1"] and a.job_id in row and row.split()[-1] == "1"
    rc, out, _ = main(lockd, capsys, "groups", "--json")
    mine = next(x for x in json.loads(out) if x["group_id"] == g)
    assert rc == 0 and mine["holder"] == a.job_id and mine["waiting"] == 1

    r = run(lockd, "status", g)
    assert f"holder   {a.job_id}  token {ga.token}" in r.stdout
    assert f"1. {b.job_id}" in r.stdout and "NODE" in r.stdout and "n2" in r.stdout
    st = json.loads(run(lockd, "--json", "status", g).stdout)   # --json before the subcommand works too
    assert st["holder"] == {"job_id": a.job_id, "token": ga.token, "priority": 0}
    assert st["grant"]["token"] == ga.token and [w["job_id"] for w in st["waiters"]] == [b.job_id]
    assert [n["node"] for n in st["node_status"]] == ["n1", "n2"]

    jobs = {j["job_id"]: j for j in json.loads(run(lockd, "jobs", "--json").stdout)}
    assert jobs[a.job_id]["groups"] == [g] and jobs[a.job_id]["lease_id"] == a.lease_id
    rc, out, _ = main(lockd, capsys, "jobs")
    assert rc == 0 and "LEASE" in out and a.job_id in out and format(a.lease_id, "x") in out

    rc, _, err = main(lockd, capsys, "group", "delete", g)
    assert rc == 1 and "queued" in err and "--force" in err
    r = run(lockd, "group", "delete", g, "--force", "--json")
    assert json.loads(r.stdout) == {"group_id": g, "deleted": True}
    rc, _, err = main(lockd, capsys, "status", g)
    assert rc == 1 and "unknown group" in err


def test_watch_count(lockd, uid, clients):
    g = f"watch-{uid}"
    c = clients(OrchestratorClient(lockd.targets, job_id=f"jw-{uid}"))
    c.create_group(g)
    env = {**os.environ, "TIMESLICE_TARGET": ",".join(lockd.targets)}
    p = subprocess.Popen([sys.executable, "-m", "timeslice.cli", "watch", g, "--count", "2", "--json"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())           # the picture at once
        assert first["group_id"] == g and first["holder"] is None
        grant = c.acquire(g)                              # a change: the second update
        second = json.loads(p.stdout.readline())
        assert second["grant"]["token"] == grant.token
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
    p = subprocess.Popen([sys.executable, "-m", "timeslice.cli", "watch", g, "--count", "1"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert "update 1" in out and f"holder   {c.job_id}" in out


def test_errors_and_usage(lockd, capsys):
    rc, out, err = main(lockd, capsys, "status", "bad/name")
    assert rc == 1 and "ill-formed" in err and out == ""
    assert cli.main([]) == 2
    assert cli.main(["group", "create", "g", "--node", "n1:x"]) == 2
    rc = cli.main(["groups", "--target", "127.0.0.1:1", "--timeout", "1"])
    assert rc == 1 and "lockd" in capsys.readouterr().err


def test_command_registry_takes_optional_modules(tmp_path, monkeypatch):
    mod = tmp_path / "ts_extra_cmd.py"
    mod.write_text(
        "def register(sub, common):\n"
        "    p = sub.add_parser('hello', parents=[common])\n"
        "    p.set_defaults(func=lambda a: print('hello', a.json) or 0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = cli.build_parser(["timeslice.cli_admin", "ts_extra_cmd", "timeslice.cli_not_there"])
    args = parser.parse_args(["hello", "--json"])
    assert args.func(args) == 0 and args.json is True
    assert {"groups", "group", "status", "watch", "jobs"} <= set(parser._subparsers._group_actions[0].choices)
    # the server side's commands plug in through entry points; the CLI's own list names none of them
    assert {"timeslice.launcher.cli_up", "timeslice.launcher.cli_demo", "timeslice.lockd.report.cli"} <= set(
        cli.plugin_modules())
    assert not any(m.startswith(("timeslice.launcher", "timeslice.lockd")) for m in cli.COMMAND_MODULES)


def test_console_script_is_installed():
    import shutil
    exe = shutil.which("timeslice", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("console script not installed in this environment")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "status" in r.stdout and "watch" in r.stdout


def test_group_create_takes_an_isolation_policy(lockd, uid, clients, capsys, monkeypatch):
    g = f"iso-{uid}"
    rc, out, err = main(lockd, capsys, "group", "create", g, "--node", "n1", "--isolation", "full", "--json")
    assert rc == 0, err
    assert json.loads(out)["isolation"] == "full"
    c = clients(OrchestratorClient(lockd.targets, job_id=f"iso-{uid}"))
    assert c.create_group(g, ["n1"], isolation="full").isolation == "full"      # the same settings: a no-op
    rc, out, err = main(lockd, capsys, "group", "create", f"{g}-d", "--node", "n1")
    assert rc == 0 and "isolation" not in out                                  # the default: none
    assert cli.main(["group", "create", g, "--isolation", "no-such-policy"]) == 2
    # The choices are lockd's list, read when the parser is built (a policy added there shows up).
    from timeslice.common.server import records as R
    monkeypatch.setattr(R, "ISOLATIONS", R.ISOLATIONS | {"strict"})
    args = cli.build_parser().parse_args(["group", "create", g, "--isolation", "strict"])
    assert args.isolation == "strict"
