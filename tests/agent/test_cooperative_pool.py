"""The cooperative backup pool through the whole system, on the SIMULATED device: real etcd, lockd, agent and
job processes; the pool is the simulator's CPU stand-in (timeslice.sim.hostpool: real bytes, every copy counted).

* a pool is admitted against the node's host memory before it is made (refused with the reason when it
  cannot be taken), and counts from its admission (and stops counting when it fails);
* a job that cooperates before its first acquire has its pool pinned before its first grant, while the
  other job keeps working on the device;
* a clean region's pause moves no bytes; a wrong "clean" claim is caught by the checksum and copied after all.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys

from agenthelpers import NODE, MiB, status, wait_agent
from test_cooperative_channel import SECRET, session
from test_cooperative_e2e import FOOTPRINT, WEIGHTS, stack_of  # noqa: F401 - stack_of: the e2e tests' fixture

from timeslice.common.server import records as R
from timeslice.sim.hostpool import ENV_PIN_GATE

TiB = 1 << 40


RESERVING = r"""
import sys
from timeslice.cooperative import CooperativeWorker
from timeslice.sim.coop import SimCooperativeMemory
job, secret, node, sock, sim_dir, gate, nbytes = sys.argv[1:8]
mem = SimCooperativeMemory({"weights": (int(nbytes), "offload")}, sim_dir, gbps=0, resident=False, pin_gate=gate)
w = CooperativeWorker(job, secret, mem, node, sock).start()
print("READY", w.pid, flush=True)
try:
    w.prepin()
    print("PINNED", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, e, flush=True)
sys.stdin.read()
"""


def _said(p: subprocess.Popen) -> str:
    """The script's next answer (its log lines go to stdout too)."""
    for line in p.stdout:
        if line.split(" ", 1)[0] in ("READY", "PINNED", "FAILED"):
            return line.strip()
    raise AssertionError(f"the pinning process exited ({p.poll()})")


def _pinning(job: str, agent, sim_dir, gate, nbytes: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RESERVING, job, SECRET, NODE, agent.socket, str(sim_dir),
                             str(gate), str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def test_a_reservation_counts_against_host_admission_from_the_moment_it_is_admitted(client, keys, agents,
                                                                                        sim_dir, tmp_path):
    """The agent admits a pinned pool before it is made (the channel's host request): a pool more than
    the host has is refused with the reason, nothing made; an admitted one counts as taken from then
    on, while it is still being reserved, so a second one that would not fit beside it is refused too;
    once the first reservation fails, its promise is withdrawn and the second one is admitted."""
    agent = agents()
    for job in ("pin-a", "pin-b", "pin-c"):
        await session(client, keys, job)
    free = (await wait_agent(client, keys, NODE, lambda a: a.host_free_bytes > 0)).host_free_bytes
    gate_a, gate_c = tmp_path / "gate-a", tmp_path / "gate-c"
    procs = []
    try:
        big = _pinning("pin-b", agent, sim_dir, tmp_path / "gate-b", TiB)    # more than any host running this
        procs.append(big)
        assert _said(big).startswith("READY")
        said = await asyncio.to_thread(_said, big)
        assert said.startswith(f"FAILED HostAdmissionRefused the node's host memory cannot take a {TiB}-byte"), said
        assert "pinned backup refused: needs" in said, said
        a = _pinning("pin-a", agent, sim_dir, gate_a, free // 2)             # waits at its gate once admitted
        procs.append(a)
        assert _said(a).startswith("READY")
        ev = await asyncio.to_thread(agent.wait_event, "host_reservation_started", 20, pid=a.pid)
        assert ev["reserving"] == free // 2
        c = _pinning("pin-c", agent, sim_dir, gate_c, free * 6 // 10)        # beside A's half: no
        procs.append(c)
        assert _said(c).startswith("READY")
        said = await asyncio.to_thread(_said, c)
        assert said.startswith("FAILED HostAdmissionRefused") and "other workers' reservations" in said, said
        gate_a.write_text("abort")                    # A's reservation fails: its promise is withdrawn
        assert (await asyncio.to_thread(_said, a)).startswith("FAILED BackupError")
        await asyncio.to_thread(agent.wait_event, "host_reservation_done", 20, pid=a.pid)
        c2 = _pinning("pin-c", agent, sim_dir, gate_c, free * 6 // 10)
        procs.append(c2)
        assert _said(c2).startswith("READY")
        ev = await asyncio.to_thread(agent.wait_event, "host_reservation_started", 20, pid=c2.pid)
        assert ev["reserving"] == free * 6 // 10
    finally:
        for gate in (gate_a, gate_c):
            if not gate.exists():
                gate.write_text("abort")              # never leave a reservation waiting (or allocating)
        for p in procs:
            p.kill()
            p.wait(10)


async def test_the_pool_is_pinned_before_the_first_grant_while_the_other_job_works(client, keys, stack_of, tmp_path):
    stack = stack_of(10 * MiB)                     # room for one job's regions: every handover pauses
    a = stack.job("hold-a")
    assert a(f"acquire g {FOOTPRINT}")["ok"]
    gate = tmp_path / "gate-b"
    b = stack.job("pin-b", env={ENV_PIN_GATE: str(gate)})
    b.send("cooperate")                            # before any hold: channel, registration, pool
    ev = await asyncio.to_thread(stack.agent.wait_event, "host_reservation_started", 30, pid=b.pid)
    assert ev["reserving"] == WEIGHTS              # the offload region only; kv is discarded
    # While B pins, A holds the group and works on the device: nothing of A waits behind it.
    assert a("write weights 0badcafe")["ok"] and a("verify weights")["match"]
    gate.write_text("go")
    coop = b._read(30)
    assert coop["ok"] and coop["host_bytes"] == WEIGHTS, coop
    await asyncio.to_thread(stack.agent.wait_event, "host_reservation_done", 20, pid=b.pid)
    assert a("yield g")["ok"]
    gb = b(f"acquire g {FOOTPRINT}")
    assert gb["ok"] and not gb["restored"], gb
    [(_, pinned_at, n)] = coop["reservations"]
    assert n == WEIGHTS and pinned_at <= coop["at"] < gb["at"]      # pinned before the first grant
    assert b("verify weights")["match"] and b("yield g")["ok"]
    for _ in range(2):                             # swaps in both directions: nobody pins again
        ga = a(f"acquire g {FOOTPRINT}")
        assert ga["ok"] and ga["restored"] and a("verify weights")["match"] and a("yield g")["ok"]
        assert (await status(client, keys, NODE, "pin-b")).bytes == WEIGHTS
        gb = b(f"acquire g {FOOTPRINT}")
        assert gb["ok"] and gb["restored"] and b("verify weights")["match"] and b("yield g")["ok"]
    sb = b("swaps")
    assert len(sb["reservations"]) == 1 and sb["backup"]["pool_grown"] == 0, sb
    assert sb["backup"]["copies_out"] == 2 and sb["backup"]["verified"] == 2


async def test_clean_pauses_move_no_bytes_and_a_wrong_claim_is_copied_after_all(client, keys, stack_of):
    stack = stack_of(10 * MiB)
    a, b = stack.job("clean-a"), stack.job("clean-b")

    async def b_takes_the_gpu() -> R.StatusValue:
        gb = b(f"acquire g {FOOTPRINT}")
        assert gb["ok"], gb
        assert b("yield g")["ok"]
        st = await status(client, keys, NODE, "clean-a")
        assert (st.state, st.outcome) == (R.SNAPSHOTTED, R.OK), st
        return st

    def a_back() -> None:
        ga = a(f"acquire g {FOOTPRINT}")
        assert ga["ok"] and ga["restored"] and a("verify weights")["match"], ga

    assert a(f"acquire g {FOOTPRINT}")["ok"] and a("clean weights")["ok"] and a("yield g")["ok"]
    assert (await b_takes_the_gpu()).bytes == WEIGHTS          # the first pause under the promise copies
    a_back()
    assert a("yield g")["ok"]
    assert (await b_takes_the_gpu()).bytes == 0                # clean: released, the pool's copy kept
    s = a("swaps")["backup"]
    assert (s["copies_out"], s["clean_skips"], s["clean_mismatches"]) == (1, 1, 0), s
    a_back()                                                   # and it comes back bit-exact
    assert a("write weights 0badcafe")["ok"] and a("yield g")["ok"]    # written, though promised clean
    assert (await b_takes_the_gpu()).bytes == WEIGHTS          # caught: copied after all
    s = a("swaps")["backup"]
    assert (s["copies_out"], s["clean_skips"], s["clean_mismatches"]) == (2, 1, 1), s
    a_back()                                                   # what A wrote is what came back
    assert a("yield g")["ok"] and a("quit")["ok"]
