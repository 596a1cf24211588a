"""Priority classes through the client library and the CLI: acquire(priority=) on both faces,
create_group(priorities=...) and `timeslice group create --priorities`, bad values refused."""
from __future__ import annotations

import asyncio
import json

import pytest

from timeslice import AsyncOrchestratorClient, InvalidArgumentError, OrchestratorClient, cli, render


async def test_higher_class_goes_first_through_the_async_client(lockd, admin, uid):
    g = f"p-{uid}"
    made = admin.create_group(g, ["node-x"], priorities=True, max_overtakes=3)
    assert (made.priorities, made.max_overtakes, made.max_wait_s) == (True, 3, 0)
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"a-{uid}") as a, \
            AsyncOrchestratorClient(lockd.targets[1:], job_id=f"low-{uid}") as low, \
            AsyncOrchestratorClient(lockd.targets[2:], job_id=f"high-{uid}") as high:
        ga = await a.acquire(g)
        t_low = asyncio.create_task(low.acquire(g, timeout=30))
        while len((await a.status(g)).waiters) < 1:
            await asyncio.sleep(0.02)
        t_high = asyncio.create_task(high.acquire(g, timeout=30, priority=7))
        while len(st := (await a.status(g)).waiters) < 2:
            await asyncio.sleep(0.02)
        assert [(w.job_id, w.priority) for w in st] == [(f"high-{uid}", 7), (f"low-{uid}", 0)]
        shown = render.status_text(await a.status(g))                 # what `timeslice status GROUP` prints
        assert f"1. high-{uid} (token {st[0].token}, class 7)" in shown
        assert f"2. low-{uid} (token {st[1].token}, class 0)" in shown
        await a.release(g)
        gh = await t_high
        assert not t_low.done()
        await high.release(g)
        gl = await t_low
        assert ga.token < gh.token < gl.token, "tokens increase in grant order"


def test_bad_priorities_are_refused_by_the_sync_client(lockd, admin, uid, clients):
    fifo, prio = f"f-{uid}", f"q-{uid}"
    admin.create_group(fifo, ["node-x"])
    admin.create_group(prio, ["node-x"], priorities=True)
    c = clients(OrchestratorClient(lockd.targets, job_id=f"s-{uid}"))
    with pytest.raises(InvalidArgumentError, match="priority"):
        c.acquire(fifo, timeout=5, priority=1)
    with pytest.raises(InvalidArgumentError, match="priority"):
        c.acquire(prio, timeout=5, priority=10)
    with pytest.raises(InvalidArgumentError):
        admin.create_group(f"x-{uid}", ["node-x"], max_overtakes=2)          # needs priorities
    assert not c.held
    assert c.acquire(prio, timeout=10, priority=9).token > 0


def test_cli_group_create_with_priorities(lockd, uid, capsys):
    g = f"c-{uid}"
    target = ["--target", ",".join(lockd.targets)]
    assert cli.main([*target, "group", "create", g, "--node", "n1", "--priorities", "--max-overtakes", "5",
                     "--max-wait-s", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["priorities"], out["max_overtakes"], out["max_wait_s"]) == (True, 5, 30)
    assert cli.main([*target, "group", "create", f"{g}-d", "--node", "n1"]) == 0
    assert "priorities" not in capsys.readouterr().out                      # the default: pure FIFO
    rc = cli.main([*target, "group", "create", f"{g}-bad", "--node", "n1", "--max-overtakes", "5"])
    assert rc != 0 and "priorities" in capsys.readouterr().err


async def test_on_accelerators_asks_for_its_class(lockd, admin, uid):
    g = f"s-{uid}"
    admin.create_group(g, ["node-x"], priorities=True)
    async with AsyncOrchestratorClient(lockd.targets, job_id=f"a-{uid}") as a, \
            AsyncOrchestratorClient(lockd.targets, job_id=f"w-{uid}") as w:
        await a.acquire(g)
        seen = []

        @w.on_accelerators(g, timeout=30, priority=6)
        async def step():
            seen.append((await a.status(g)).holder)

        t = asyncio.create_task(step())
        while not (st := (await a.status(g)).waiters):
            await asyncio.sleep(0.02)
        assert [(x.job_id, x.priority) for x in st] == [(f"w-{uid}", 6)]
        await a.release(g)
        await t
        assert seen[0].job_id == f"w-{uid}" and seen[0].priority == 6
    with OrchestratorClient(lockd.targets, job_id=f"x-{uid}") as c:
        with pytest.raises(InvalidArgumentError, match="priority"):
            with c.on_accelerators(g, timeout=5, priority=10):
                pass
