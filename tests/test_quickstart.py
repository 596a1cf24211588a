"""docs/QUICKSTART.md, run from the page's own text, on the CPU, as a newcomer would.

The page's blocks, in order: each ```python <file> block is saved under its name, each ```bash
block is run (```bash install, the clone and set-up, is what this checkout already did). The
commands run in a folder of their own that holds a link to this checkout's .venv, with no
TIMESLICE_* variable at all (the per-user state folder is a fresh XDG_STATE_HOME), so the page
cannot lean on anything it does not print. Then what the page promises is checked: `up` prints
the simulated device's export line, both TRL jobs exit 0 and are bit-identical to their runs
alone with swaps in between, the plain loop runs, `report --json` has the group's figures, and
`up --stop` leaves nothing running.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the quick start's jobs need the test extra (torch, trl)")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "QUICKSTART.md"
_BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, str, str]]:
    """(language, the rest of the info string, body) of every fenced block, in page order."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in _BLOCK.finditer(PAGE.read_text())]


def test_the_page_names_its_files_and_commands():
    kinds = [(lang, info) for lang, info, _ in blocks()]
    assert ("bash", "install") in kinds
    assert {info for lang, info in kinds if lang == "python"} == {"my_trl_job.py", "compare.py", "my_loop.py"}
    assert sum(1 for lang, info in kinds if lang == "bash" and not info) >= 5


def test_the_readme_first_screen_links_the_quick_start():
    first = "\n".join(PAGE.parent.parent.joinpath("README.md").read_text().splitlines()[:20])
    assert "docs/QUICKSTART.md" in first
    assert "bash scripts/demo.sh" in first and "bash scripts/test.sh" in first


@pytest.mark.slow
@pytest.mark.timeout(1200)   # seven job processes in turn (TRL imports, 16 steps each): 10 min on a loaded 2-core box
def test_the_quick_start_runs_end_to_end_from_its_own_text(tmp_path, request):
    if shutil.which("etcd") is None and not os.environ.get("TIMESLICE_ETCD_BIN"):
        pytest.skip("no etcd on PATH")
    # A short folder: the agent's socket lives in the run folder `up` makes below it, and a Unix
    # socket's path is at most 107 bytes (pytest's own temporary paths can be longer).
    work = Path(tempfile.mkdtemp(prefix="ts-qs-"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    (work / ".venv").symlink_to(ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_") or k == "TIMESLICE_ETCD_BIN"}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"), HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    (tmp_path / "home").mkdir()
    outputs: list[str] = []

    def bash(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)
    stopped_again = None
    try:
        commands = ""
        for lang, info, body in blocks():
            if lang == "python" and info:
                (work / info).write_text(body)
            elif lang == "bash" and not info:
                commands += body                 # one shell: `source .venv/bin/activate` holds for the rest
                p = bash(commands)
                assert p.returncode == 0, f"the page's commands failed:\n{body}\n--- stdout\n{p.stdout[-4000:]}" \
                                          f"\n--- stderr\n{p.stderr[-4000:]}"
                outputs.append(p.stdout + p.stderr)
                commands = "source .venv/bin/activate\n"   # the next block runs in the same set-up
    finally:
        stopped_again = bash("source .venv/bin/activate && timeslice up --stop", timeout=120)
    text = "\n".join(outputs)
    up = outputs[0]
    assert re.search(r"export TIMESLICE_SIM_DIR=\S+", up), up[-2000:]
    assert "both jobs exited 0" in text
    for job in ("job-a", "job-b"):
        assert f"{job}: bit-identical to its run alone" in text, text[-3000:]
        sliced = json.loads((work / f"{job}-sliced.json").read_text())
        assert sliced["swaps"] >= 2
    report = json.loads((work / "report.json").read_text())
    local = report["figures"]["local"]
    assert local["swaps"] > 0 and {"job-a", "job-b", "loop-1"} <= set(local["jobs"])
    # up's group is a fit group (deploy/local.env GROUP_SHARING): holds overlap only there, where they fit
    assert local["overlaps"] == 0 or local.get("sharing") == "fit", local
    assert "duty" in text and "over" in text and "fit beside" in text
    # the page's `up --stop` stopped it: a second stop finds nothing running
    assert stopped_again is not None and stopped_again.returncode == 1, stopped_again
    assert "no running local cluster" in stopped_again.stderr
