"""A grant is a promise the GPU is usable: grants admit measured footprints, the first hold gets room
to spare, an allocation that does not fit inside a hold makes room before it fails, and host memory is
admitted before a pinned backup is made.

End to end on one SIMULATED GPU of 64 MiB that charges each process a 1 MiB context (as a GPU does:
timeslice.common.sim.device): real etcd, one lockd replica, the node agent, and cooperative jobs in
their own processes (tests/scripts/coop_job.py: the public client and SimCooperativeMemory), whose
temporaries inside a hold (``scratch``) are real bytes on the device. Sizes, per process: the device's
context, the memory's own context arena (1 MiB, or 4 MiB where said) and its regions.
"""
from __future__ import annotations

from agenthelpers import NODE, MiB, status
from jobhelpers import Job

from timeslice.common.server import records as R
from timeslice.sim.runtime import SimDeviceClient

CAP = 64 * MiB
DEVICE_CTX = 1 * MiB


def ok(answer: dict) -> dict:
    """The job's answer, which must say ok (else the test fails showing it)."""
    assert answer.get("ok"), answer
    return answer


def weights(n_mib: int) -> str:
    return f"weights:{n_mib * MiB}:offload"


async def test_an_allocation_that_does_not_fit_makes_room_and_when_nothing_is_left_says_who_holds(
        keys, client, lockd_node, sim_dir):
    """C (26 MiB: 24 of weights) is parked by A's grant and keeps 2 MiB (its residue); a process no job
    registered holds 5 MiB. A (26 MiB) asks for a 32 MiB temporary with 31 MiB free: the agent moves
    C's residue off the device and the allocation succeeds on its retry. A 34 MiB one then cannot be
    given room: the error says who holds the device. C's weights come back bit-exact after all."""
    async with lockd_node(CAP, context_bytes=DEVICE_CTX, slack=0.0) as n:
        ballast = SimDeviceClient.open(sim_dir)
        ballast.alloc(4 * MiB)                              # + the device's 1 MiB context: 5 MiB, unregistered
        c = Job(n.lockd.replicas[0].target, "coop-c", sim_dir, n.agent.socket, weights(24))
        a = Job(n.lockd.replicas[0].target, "coop-a", sim_dir, n.agent.socket, weights(24))
        try:
            ok(c(f"acquire g {24 * MiB}")), ok(c("write weights 0badcafe")), ok(c("yield g"))
            g = a(f"acquire g {30 * MiB}")
            assert g["ok"], g
            st = await status(client, keys, NODE, "coop-c")
            assert st.state == R.SNAPSHOTTED and st.residue_bytes == 2 * MiB, st   # parked, its residue left
            got = a(f"scratch {32 * MiB}")
            assert got == {"ok": True, "room_asks": 1}, got                       # made room, then fit
            st = await status(client, keys, NODE, "coop-c")
            assert st.state == R.SNAPSHOTTED and st.residue_bytes == 0, st         # the residue went to the host
            no = a(f"scratch {34 * MiB}")
            assert not no["ok"] and no["error"].startswith("NoRoom: out of device memory inside the hold"), no
            assert "34.0 MiB more needed on sim0" in no["error"] and "33.0 MiB free" in no["error"], no
            assert "job coop-a (26.0 MiB, this job)" in no["error"], no
            assert f"pid {ballast.pid} (no job registered it) (5.0 MiB" in no["error"], no
            ok(a("yield g"))
            back = c(f"acquire g {24 * MiB}")
            assert back["ok"] and back["restored"], back
            assert c("verify weights")["match"]
            ok(c("yield g"))
        finally:
            a.kill()
            c.kill()
            ballast.close()


async def test_a_job_that_declares_20_percent_too_little_runs_beside_a_parked_job_granted_from_its_peaks(
        keys, client, lockd_node, sim_dir):
    """A declares 30 MiB; its generate phase holds 38 MiB (18 MiB resident + a 20 MiB temporary) and its
    train phase grows past it to 61 MiB (a 43 MiB temporary). C (29 MiB: 24 of weights, a 5 MiB residue
    when parked) takes its turn between A's phases. The first hold's spare parks C (on A's declaration
    alone C would have stayed resident, and A's temporary would not have fit); the train phase that grew
    past its grant makes room (C's residue goes); every later grant is planned on the peak A measured
    (61 MiB, sent with its next Acquire), so C's residue leaves before the grant and no allocation ever
    asks for room again. Every phase of A runs; C's weights are bit-exact at each of its turns."""
    async with lockd_node(CAP, context_bytes=DEVICE_CTX, slack=0.0) as n:
        target = n.lockd.replicas[0].target
        c = Job(target, "coop-c", sim_dir, n.agent.socket, weights(24), env={"COOP_JOB_CONTEXT_BYTES": str(4 * MiB)})
        a = Job(target, "coop-a", sim_dir, n.agent.socket, weights(16))
        try:
            ok(c(f"acquire g {24 * MiB}")), ok(c("write weights 0badcafe")), ok(c("yield g"))
            asks = []
            for _ in range(3):
                for scratch in (20, 43):                     # generate, then train
                    g = a(f"acquire g {30 * MiB}")
                    assert g["ok"], g
                    got = a(f"scratch {scratch * MiB}")
                    assert got["ok"], got
                    asks.append(got["room_asks"])
                    ok(a("yield g"))
                    turn = c(f"acquire g {24 * MiB}")
                    assert turn["ok"] and turn["restored"], turn
                    assert c("verify weights")["match"]
                    ok(c("yield g"))
            # Only the train phase that first grew past its grant asked for room.
            assert asks == [0, 1, 1, 1, 1, 1], asks
            m = a("measured g")
            assert (m["peak"], m["context"]) == (59 * MiB, 2 * MiB), m   # 16 + 43 allocated; 1 + 1 beside
        finally:
            a.kill()
            c.kill()


async def test_a_first_hold_gets_room_to_spare_a_later_one_its_measured_footprint(keys, client, lockd_node,
                                                                                  sim_dir):
    """A declares 47 MiB, no peak observed yet: with its context and the margin it fits beside C's 5 MiB
    residue (59 MiB free), with a first hold's spare it does not, so C's residue goes before A's first
    grant. At A's next hold its measured peak (44 MiB) stands beside the declaration: no spare, and C's
    residue stays on the device."""
    async with lockd_node(CAP, context_bytes=DEVICE_CTX, slack=0.0) as n:
        target = n.lockd.replicas[0].target
        c = Job(target, "coop-c", sim_dir, n.agent.socket, weights(24), env={"COOP_JOB_CONTEXT_BYTES": str(4 * MiB)})
        a = Job(target, "coop-a", sim_dir, n.agent.socket, weights(16))
        try:
            ok(c(f"acquire g {24 * MiB}")), ok(c("yield g"))
            ok(a(f"acquire g {47 * MiB}"))
            st = await status(client, keys, NODE, "coop-c")
            assert st.state == R.SNAPSHOTTED and st.residue_bytes == 0, st          # moved before the grant
            assert a(f"scratch {28 * MiB}") == {"ok": True, "room_asks": 0}
            ok(a("yield g"))
            ok(c(f"acquire g {24 * MiB}"))
            assert ok(c("verify weights"))["match"]
            ok(c("yield g")), ok(a(f"acquire g {47 * MiB}"))
            st = await status(client, keys, NODE, "coop-c")
            assert st.state == R.SNAPSHOTTED and st.residue_bytes == 5 * MiB, st    # parked, residue kept
            assert a(f"scratch {28 * MiB}") == {"ok": True, "room_asks": 0}
            ok(a("yield g"))
        finally:
            a.kill()
            c.kill()


async def test_a_pinned_backup_the_host_cannot_take_is_refused_before_it_is_made_and_the_job_told(
        keys, client, lockd_node, sim_dir):
    """The node agent counts every pinned pool against the node's host memory before it is made: here it
    keeps more in reserve than the host has, so a job's backup pool is refused at its cooperate, with
    the reason, and nothing is pinned."""
    async with lockd_node(CAP, agent_extra=["--host-reserve-bytes", str(1 << 55)]) as n:
        a = Job(n.lockd.replicas[0].target, "coop-a", sim_dir, n.agent.socket, weights(16))
        try:
            r = a("cooperate")
            assert not r["ok"], r
            assert r["error"].startswith("HostAdmissionRefused: the node's host memory cannot take a "
                                         f"{16 * MiB}-byte pinned backup now"), r
            assert "pinned backup refused: needs" in r["error"], r
        finally:
            a.kill()
