"""Fit groups through the client library and the CLI: create_group(sharing=) and `--sharing fit`,
acquire(exclusive=) on both faces, bad policies refused, what status and jobs show, and the
integrations' allocator cap (a stand-in for torch.cuda, as the cache release's tests use)."""
from __future__ import annotations

import json
import types

import pytest

from tests.client.helpers import fake_torch
from timeslice import InvalidArgumentError, OrchestratorClient, cli, render
from timeslice.hooks import cap_allocator
from timeslice.room import describe


def test_create_group_with_sharing_and_bad_policies_refused(lockd, admin, uid, clients):
    g = admin.create_group(f"f-{uid}", ["node-x"], sharing="fit")
    assert g.sharing == "fit"
    assert admin.create_group(f"e-{uid}", ["node-x"]).sharing == "exclusive"       # the API's default
    with pytest.raises(InvalidArgumentError, match="sharing"):
        admin.create_group(f"x-{uid}", ["node-x"], sharing="shared")
    assert f"x-{uid}" not in {gg.group_id for gg in admin.groups()}                 # nothing written
    # The same name with another policy is another group: refused, the first one kept.
    with pytest.raises(Exception, match="sharing"):
        admin.create_group(f"f-{uid}", ["node-x"], sharing="exclusive")
    c = clients(OrchestratorClient(lockd.targets, job_id=f"j-{uid}"))
    # No agent on node-x: nothing is known of its GPUs, so even a declared grant weighs the whole device.
    gr = c.acquire(f"f-{uid}", timeout=10, device_bytes_hint=1 << 20)
    assert gr.exclusive and gr.footprint_bytes == {}
    st = c.status(f"f-{uid}")
    assert st.sharing == "fit" and [h.job_id for h in st.holders] == [f"j-{uid}"] and st.holders[0].exclusive
    assert "sharing  fit" in render.status_text(st) and "weighs the whole device" in render.status_text(st)
    jobs = {j.job_id: j for j in c.jobs()}
    assert [(h.group_id, h.exclusive) for h in jobs[f"j-{uid}"].holds] == [(f"f-{uid}", True)]
    c.release(f"f-{uid}")
    # exclusive=True on an exclusive group changes nothing: granted as ever.
    assert c.acquire(f"e-{uid}", timeout=10, exclusive=True).token > 0


def test_cli_group_create_with_sharing(lockd, uid, capsys):
    g = f"c-{uid}"
    target = ["--target", ",".join(lockd.targets)]
    assert cli.main([*target, "group", "create", g, "--node", "n1", "--sharing", "fit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sharing"] == "fit"
    assert cli.main([*target, "status", g, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sharing"] == "fit" and out["holders"] == []
    assert cli.main([*target, "group", "create", f"{g}-b", "--node", "n1", "--sharing", "shared"]) != 0
    assert "invalid choice" in capsys.readouterr().err


def test_the_exclusive_flag_rides_on_every_acquire_request(lockd, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"r-{uid}"))
    core = c._aio._core
    assert core.acquire_req("g", 5, exclusive=True).exclusive
    assert not core.acquire_req("g", 5).exclusive
    scope = c.on_accelerators("g", exclusive=True)
    assert scope.exclusive and scope._fresh().exclusive        # the decorator's fresh scope keeps it


class Cuda:
    """torch.cuda as the cap sees it: initialised, one device of 80 bytes, fractions recorded."""

    def __init__(self, initialized=True):
        self.initialized, self.fractions = initialized, []

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return 0

    def get_device_properties(self, d):
        return types.SimpleNamespace(total_memory=80)

    def set_per_process_memory_fraction(self, f, device=None):
        self.fractions.append(f)


def test_the_allocator_is_capped_at_the_admitted_footprint_and_the_cap_lifted_when_alone(monkeypatch):
    cuda = Cuda()
    fake_torch(monkeypatch, cuda)
    assert cap_allocator({"n1/0": 20, "n2/0": 70}, False, "n1") == 20 and cuda.fractions == [0.25]
    # An allocation that then finds no room says why: the cap, and what to do about it.
    assert "capped at" in describe(1 << 30, "gpu0", None) and "device_bytes_hint" in describe(1 << 30, "gpu0", None)
    assert cap_allocator({}, True, "n1") == 0 and cuda.fractions[-1] == 1.0          # exclusive: no cap
    assert "capped at" not in describe(1 << 30, "gpu0", None)
    assert cap_allocator({"n1/0": 1, "n1/1": 1}, False, "n1") is None               # two GPUs: not guessed
    cuda.initialized = False
    assert cap_allocator({"n1/0": 20}, False, "n1") is None and len(cuda.fractions) == 2   # never inits CUDA
