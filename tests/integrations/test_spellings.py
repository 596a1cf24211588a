"""TimeSlice (what the TRL integration drives) works with both spellings of the client the RL code
is written against: ``TimeSliceOrchestratorClient(target=...)`` (job id from the environment) and
``OrchestratorClient(job_id=...)`` (target from the environment); a real lockd on real etcd."""
from __future__ import annotations

import pytest

from timeslice import OrchestratorClient, TimeSliceOrchestratorClient
from timeslice.integrations.slicing import TimeSlice
from timeslice.testing.lockd import LockdCluster


@pytest.fixture
def lockd(etcd, key_prefix, tmp_path):
    c = LockdCluster(etcd.endpoints_str, key_prefix, n=1, logdir=str(tmp_path)).start()
    with OrchestratorClient(target=c.replicas[0].target, job_id="admin") as admin:
        admin.create_group("rl-gpus", nodes=["no-agent-node"])      # nothing to move: holds only
    yield c.replicas[0].target
    c.stop()


def test_both_client_spellings_hold_and_release_through_timeslice(lockd, monkeypatch):
    monkeypatch.setenv("TIMESLICE_JOB_ID", "spelled-by-target")
    monkeypatch.setenv("TIMESLICE_TARGET", lockd)
    with TimeSliceOrchestratorClient(target=lockd) as a, OrchestratorClient(job_id="spelled-by-id") as b:
        assert (a.job_id, b.target) == ("spelled-by-target", lockd)
        for client in (a, b):
            ts = TimeSlice(client, "rl-gpus", swap="none")
            with ts.hold() as grant:
                assert grant.job_id == client.job_id and "rl-gpus" in client.held
                with ts.released("rewards"):
                    assert "rl-gpus" not in client.held          # the group is free for others here
                assert "rl-gpus" in client.held                 # and held again after
            assert "rl-gpus" not in client.held
            toks = [e["token"] for e in ts.log.events if e["ev"] == "hold"]
            assert len(toks) == 2 and toks[1] > toks[0]         # two holds, two grants
