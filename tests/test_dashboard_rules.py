"""The Grafana dashboard and the alert rules in deploy/ name only metrics the code exports.

Exported names come from the metrics classes themselves (lockd and the node
agent), so renaming a metric in code without updating deploy/ fails here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from timeslice.lockd.metrics import LockdMetrics
from timeslice.nodeagent.metrics import Metrics as AgentMetrics

MON = Path(__file__).resolve().parents[1] / "deploy" / "components" / "monitoring"
NAME_RE = re.compile(r"\b(timeslice_[a-z0-9_]+)")


def exported() -> set[str]:
    names: set[str] = set()
    lockd, agent = LockdMetrics(), AgentMetrics()
    agent.duty.gpu_utilization = lambda: {"0": 0.5}     # so the collector yields a sample
    agent.duty.note_resident(["j"])
    lockd.queue_depth.labels("g").set(1)
    for registry in (lockd.registry, agent.registry):
        for fam in registry.collect():
            names.add(fam.name)
            for suffix in ("_total", "_bucket", "_count", "_sum", "_info"):
                names.add(fam.name + suffix)
            names.update(s.name for s in fam.samples)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((MON / "timeslice-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def rule_queries() -> list[tuple[str, str]]:
    doc = yaml.safe_load((MON / "rules.yaml").read_text())
    return [(r["alert"], r["expr"]) for g in doc["spec"]["groups"] for r in g["rules"]]


def unknown(queries: list[tuple[str, str]]) -> list[str]:
    names = exported()
    return [f"{title}: {m}" for title, expr in queries for m in NAME_RE.findall(expr) if m not in names]


def test_every_panel_queries_an_exported_metric():
    qs = dashboard_queries()
    assert len(qs) >= 8
    assert all(NAME_RE.search(e) for _, e in qs), "a panel without a timeslice metric"
    assert unknown(qs) == []


def test_every_alert_queries_an_exported_metric():
    qs = rule_queries()
    assert {t for t, _ in qs} >= {"TimesliceNoLeader", "TimesliceAgentDown", "TimesliceSwapsFailing",
                                  "TimesliceEtcdUnreachable"}
    assert unknown(qs) == []


def test_the_check_catches_a_renamed_metric():
    assert unknown([("p", "rate(timeslice_agent_bytes_moved_total[5m])")]) == ["p: timeslice_agent_bytes_moved_total"]


def test_dashboard_shows_duty_cycle_queue_wait_swap_and_failovers():
    text = " ".join(e for _, e in dashboard_queries())
    for needed in ("timeslice_agent_gpu_utilization_ratio", "timeslice_queue_depth", "timeslice_acquire_wait_seconds",
                   "timeslice_swap_phase_seconds", "timeslice_agent_moved_bytes_total", "timeslice_leader_changes_total"):
        assert needed in text, needed


def test_residency_is_credited_per_job_and_forgotten_when_gone():
    m = AgentMetrics()
    m.duty.note_resident(["a", "b"], now=100.0)
    m.duty.note_resident(["a", "b"], now=102.5)
    m.duty.note_resident(["a"], now=103.0)          # b left the device: its series goes
    m.duty.note_resident(["a", "c"], now=104.0)     # c arrives: counted from the next call on
    samples = {s.labels["job"]: s.value for f in m.registry.collect()
               if f.name == "timeslice_agent_job_resident_seconds" for s in f.samples}
    assert samples == {"a": 4.0, "c": 0.0}
