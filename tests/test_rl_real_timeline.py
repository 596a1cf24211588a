"""benchmarks/rl_real_timeline.py: the grant order and FIFO check, waits, and what ran beside each GPU phase,
from job documents made here (sans-IO)."""
from __future__ import annotations

from benchmarks import rl_real_timeline as T


def hold(req, grant, release, **kw):
    return {"ev": "hold", "t_req": req, "t_grant": grant, "t_release": release, "waited_ms": 0, "restored": False,
            "elided": False, **kw}


def span(name, start, end, gpu=True, **kw):
    return {"ev": "span", "name": name, "start": start, "end": end, "gpu": gpu, **kw}


def doc(job, events, **kw):
    return {"job": job, "events": events, **kw}


def test_the_order_and_waits_of_three_jobs_in_fifo():
    a = doc("job-a", [hold(0.0, 0.0, 1.0), hold(2.0, 3.0, 4.0)])
    b = doc("job-b", [hold(0.1, 1.0, 2.0), hold(4.5, 4.5, 5.0)])
    c = doc("job-c", [hold(0.2, 2.0, 3.0)])
    o = T.order([a, b, c])
    assert o["order"] == "abcab" and o["fifo_inversions"] == 0
    w = T.waits([a, b, c])
    assert w["job-c"] == {"n": 1, "mean_s": 1.8, "max_s": 1.8, "total_s": 1.8}
    assert w["job-a"]["max_s"] == 1.0 and w["job-b"]["n"] == 2


def test_a_grant_past_an_older_waiter_is_an_inversion_unless_a_backfill():
    a = doc("job-a", [hold(0.0, 0.0, 1.0)])
    b = doc("job-b", [hold(0.1, 2.0, 3.0)])             # waited since 0.1 ...
    c = doc("job-c", [hold(0.5, 1.0, 2.0)])             # ... but c, asking at 0.5, went first
    o = T.order([a, b, c])
    assert o["fifo_inversions"] == 1 and o["inversions"][0]["granted"] == "c"
    assert o["inversions"][0]["waited_longer"] == "b"
    c["events"][0]["backfilled"] = True                 # a fit group's backfill beside the head: allowed
    assert T.order([a, b, c])["fifo_inversions"] == 0
    near = doc("job-c", [hold(0.12, 1.0, 2.0)])         # within the clocks' tolerance: not counted
    assert T.order([a, b, near])["fifo_inversions"] == 0


def test_what_ran_beside_each_generate_span_and_its_ratio_to_standalone():
    alone = [doc("standalone", [span("generate", 0, 1, tokens=100), span("generate", 5, 6, tokens=100)]),
             doc("standalone", [span("generate", 0, 1, tokens=100), span("generate", 5, 6, tokens=100)])]
    a = doc("job-a", [span("generate", 10, 11, tokens=100),                # alone on the host: x1.0
                      span("generate", 20, 21.25, tokens=100)],            # beside b's resume: x0.8
            pin={"windows": [[10.5, 11.5, 1 << 30]]})                      # its own pin, half its first span
    b = doc("job-b", [span("generate", 30, 31, tokens=100), span("rewards", 20.5, 21.25, gpu=False),
                      span("generate", 40, 42, tokens=100)],
            ops=[["resume", 20.0, 20.5, 1 << 30], ["ping", 20.0, 21.0, 0]])
    b["events"][1]["gpu"] = False
    got = T.beside([a, b], alone)
    sa = got["jobs"]["job-a"]["spans"]
    assert [s["ratio"] for s in sa] == [1.0, 0.8]
    assert sa[0]["pin"] == 0.5 and sa[0]["swap"] == 0.0
    assert sa[1]["swap"] == 0.4 and sa[1]["cpu"] == 0.6 and sa[1]["gpu"] == 0.0
    assert got["jobs"]["job-b"]["median_ratio"] == 0.75
    swap = got["by_cause"]["swap"]
    assert swap["touched"] == 1 and swap["median_ratio_touched"] == 0.8 and swap["median_ratio_untouched"] == 1.0
    assert "order" in T.text(T.timeline([a, b], alone))


def test_another_jobs_gpu_span_counts_only_while_it_held():
    """A TRL step's span goes on while it waits for its next grant (after its rewards): not GPU work."""
    alone = [doc("standalone", [span("generate", 0, 1, tokens=100)])] * 2
    a = doc("job-a", [span("generate", 2, 3, tokens=100), hold(2, 2, 3)])
    b = doc("job-b", [span("train_step", 0, 4), hold(0, 0, 1), hold(1.5, 3.5, 4)])   # waiting from 1.5 to 3.5
    got = T.beside([a, b], alone)
    assert got["jobs"]["job-a"]["spans"][0]["gpu"] == 0.0
