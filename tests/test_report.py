"""`timeslice report`: two jobs swap on the SIMULATED device (real etcd, lockd, agent), then the
report's HTML (and PNG) are opened and checked against what the jobs themselves recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from timeslice.common.server.keys import Keys
from timeslice.common.sim.device import SimDevice
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdCluster

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "examples" / "grpo" / "grpo_job.py"
NODE, GROUP, MiB = "rep-node", "rl", 1 << 20


class Page(HTMLParser):
    """What a reader of the page sees: the holds table's rows, the SVG's hold bars, every link."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self.bars = 0
        self.external: list[str] = []
        self.data = ""
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in ("src", "href"):
            if a.get(name) and not a[name].startswith("#"):
                self.external.append(a[name])
        if tag == "link":
            self.external.append(str(a))
        if tag == "table":
            self._table = a.get("class")
        elif tag == "tr" and self._table == "holds" and a.get("class") == "hold":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "rect" and a.get("class") == "hold":
            self.bars += 1
        elif tag == "script" and a.get("id") == "timeslice-report":
            self._script = True

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "script":
            self._script = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._script:
            self.data += data


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never happened within {timeout}s: {what}")


@pytest.mark.slow
def test_report_shows_every_hold_swap_and_wait_of_two_jobs(etcd, key_prefix, tmp_path):
    sim, host = tmp_path / "sim", tmp_path / "host"
    SimDevice(sim, host, capacity_bytes=64 * MiB)            # two 40 MiB jobs never fit: every handoff swaps
    lockd = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
    agent = AgentProcess(etcd.endpoints_str, key_prefix, NODE, str(tmp_path), sim_dir=sim,
                         env={"TIMESLICE_SIM_HOST_DIR": str(host)},
                         extra=["--sim-checkpoint-gbps", "0", "--sim-restore-gbps", "0"]).start()
    try:
        from timeslice import OrchestratorClient
        target = lockd.replicas[0].target
        with OrchestratorClient(target, job_id="report-admin") as admin:
            admin.create_group(GROUP, nodes=[NODE])
        t0 = time.time()
        events = tmp_path / "events.jsonl"
        env = {**os.environ, "TIMESLICE_TARGET": target, "TIMESLICE_NODE_NAME": NODE, "TIMESLICE_SIM_DIR": str(sim),
               "TIMESLICE_SIM_HOST_DIR": str(host), "TIMESLICE_AGENT_SOCKET": agent.socket}
        jobs = [subprocess.Popen([sys.executable, str(GRPO), "--group", GROUP, "--iterations", "2", "--phase-s", "0.1",
                                  "--events", str(events)], env={**env, "TIMESLICE_JOB_ID": job},
                                 stdout=subprocess.PIPE, text=True) for job in ("rep-a", "rep-b")]
        finals = []
        for p in jobs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            finals.append(json.loads(out.strip().splitlines()[-1]))
        holds = sum(f["holds"] for f in finals)                # each job's GPU phases and its last check
        phases = [json.loads(line) for line in events.read_text().splitlines()]
        history = Keys(key_prefix).history().decode()

        def recorded() -> int:
            return len(etcd.etcdctl("get", "--prefix", "--keys-only", history).split())
        wait_for(lambda: recorded() == holds, 20, f"the leader's {holds} records of finished holds")

        html_path, png_path = tmp_path / "report.html", tmp_path / "report.png"
        r = subprocess.run([sys.executable, "-m", "timeslice.cli", "report", "--since", "10m", "--json",
                            "--etcd-endpoints", etcd.endpoints_str, "--prefix", key_prefix,
                            "-o", str(html_path), "--png", str(png_path)],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert summary["holds"] == holds and summary["groups"] == 1
        text_out = subprocess.run([sys.executable, "-m", "timeslice.cli", "report", "--since", "30m",
                                   "--etcd-endpoints", etcd.endpoints_str, "--prefix", key_prefix,
                                   "-o", str(tmp_path / "again.html")],
                                  capture_output=True, text=True, timeout=120, check=False).stdout
    finally:
        agent.stop()
        lockd.stop()

    page = Page()
    text = html_path.read_text()
    page.feed(text)
    assert page.external == [], "the page must be self-contained"
    data = json.loads(page.data)
    [g] = data["groups"]
    assert g["group"] == GROUP and g["nodes"] == [NODE] and g["overlaps"] == 0
    by_token = {h["token"]: h for h in g["holds"]}
    assert len(by_token) == holds
    for ph in phases:                                          # what each job saw, hold by hold
        h = by_token[ph["token"]]
        assert (h["job"], h["restored"], h["elided"], h["bytes_moved"]) == (
            ph["job"], ph["restored"], ph["elided"], ph["bytes_moved"])
        assert h["start"] <= ph["t_start"] and ph["t_end"] <= h["end"] + 0.05
        assert t0 - 1 <= h["start"] and h["waited_s"] is not None and h["waited_s"] >= 0
    swapped = [h for h in g["holds"] if h["bytes_moved"] > 0]
    assert g["swaps"] == len(swapped) >= 2 and g["handoffs"] >= 2
    assert g["bytes_moved"] == sum(h["bytes_moved"] for h in g["holds"])
    for h in swapped:                                          # the agent's side of each swap
        assert sum(op["bytes"] for op in h["swaps"]) == h["bytes_moved"], h
        restores = [op for op in h["swaps"] if op["op"] == "restore"]
        assert bool(restores) == h["restored"]
        assert all(op["job"] == h["job"] and op["gpu_bytes"] == {"sim0": 40 * MiB} for op in restores)
        assert all(op["job"] != h["job"] for op in h["swaps"] if op["op"] == "snapshot")
    assert {(gf["node"], gf["gpu"]) for gf in g["gpus"]} == {(NODE, "sim0")}
    assert sum(gf["bytes_in"] for gf in g["gpus"]) == sum(
        op["bytes"] for h in g["holds"] for op in h["swaps"] if op["op"] == "restore")
    assert 0 < g["duty"] <= 1 and g["held_s"] == pytest.approx(sum(h["end"] - h["start"] for h in g["holds"]), abs=1e-6)
    # The same, as a reader sees it: a table row and a bar per hold, each with its job and token.
    assert len(page.rows) == holds and page.bars == holds
    assert {(row[0], int(row[1])) for row in page.rows} == {(h["job"], h["token"]) for h in g["holds"]}
    assert f"{g['duty']:.1%}" in text
    # --json carries the figures a tool needs, without the page: the same numbers as the page's
    f = summary["figures"][GROUP]
    assert (f["holds"], f["swaps"], f["restored"], f["handoffs"], f["overlaps"], f["bytes_moved"]) == (
        holds, g["swaps"], g["restored"], g["handoffs"], 0, g["bytes_moved"])
    assert f["elided"]["total"] == f["elided"]["fit_beside"] + f["elided"]["partial_pause"] == g["elided"]
    assert f["waits"]["count"] == holds and f["waits"]["max_s"] >= f["waits"]["p50_s"] >= 0
    # duty is over the window in which the jobs waited and held (a few seconds), not the 10 minutes asked
    win = f["duty_window"]
    assert t0 - 1 <= win["from"] < win["to"] and win["s"] < 120
    assert f["duty"] == pytest.approx(g["held_s"] / win["s"], abs=1e-3) and f["duty"] > 5 * f["window_share"]
    # and a person sees the window it is over (30 minutes asked, the same few seconds)
    assert f"over {time.strftime('%H:%M:%S', time.localtime(win['from']))}" in text_out
    assert "fit beside" in text_out and "partial pause" in text_out

    import matplotlib.image as mpimg
    img = mpimg.imread(png_path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 400
    assert len({tuple(px) for px in img.reshape(-1, img.shape[2])[::97]}) > 5, "a picture, not a blank"


def _rec(job: str, token: int, granted: float, released: float, enqueued: float, *, elided=False, swaps=()):
    from timeslice.common.server import records as R
    return R.HoldRecord(GROUP, job, token, 1, enqueued_ms=int(enqueued * 1000), granted_ms=int(granted * 1000),
                        released_ms=int(released * 1000), elided=elided,
                        bytes_moved=sum(op["bytes"] for op in swaps), swaps=list(swaps))


def test_elided_holds_are_split_and_duty_is_over_the_active_window():
    """Sans-IO: an elided grant that paused nobody fit beside the resident job; one whose swap paused
    the other in part is a partial pause. Duty is over the first wait to the last release."""
    from timeslice.lockd.report import page as rpt
    t = 1_000_000.0
    part = [{"node": NODE, "op": "snapshot", "job": "a", "bytes": 4 * MiB, "elapsed_ms": 5, "gpu_bytes": {}}]
    recs = [_rec("a", 10, t + 1, t + 3, t + 0.5),
            _rec("b", 11, t + 3, t + 4, t + 2, elided=True),                     # fit beside a
            _rec("a", 12, t + 4, t + 5, t + 3.5, elided=True, swaps=part[:0]),   # fit beside b
            _rec("b", 13, t + 5, t + 6.5, t + 4.5, elided=True, swaps=part)]     # a paused in part
    rep = rpt.build(recs, {}, {}, {}, since=t - 1800, until=t + 100)
    [g] = rep.groups
    assert (g.elided, g.elided_fit_beside, g.elided_partial_pause) == (3, 2, 1)
    assert (g.active_from, g.active_to) == (t + 0.5, t + 6.5)
    assert g.duty == pytest.approx(5.5 / 6.0) and g.window_share == pytest.approx(5.5 / 1900)
    f = rpt.figures(rep)[GROUP]
    assert f["elided"] == {"total": 3, "fit_beside": 2, "partial_pause": 1}
    assert f["duty_window"]["s"] == pytest.approx(6.0)
    assert "duty 91.7% over" in rpt.text(rep) and "2 fit beside, 1 partial pause" in rpt.text(rep)
