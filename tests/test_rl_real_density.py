"""benchmarks/rl_real_density.py: the bound an N-job mix can reach, its targets, and advise's prediction
against what ran, from documents and profiles made here (sans-IO)."""
from __future__ import annotations

from benchmarks import rl_real_density as D
from timeslice.advise.profile import GpuSet, JobProfile, NodeInfo, ProfileSet

MiB = 1 << 20


def regime(nvml, tok, smp, wall, mix="none", ok=True, codes=(0, 0, 0, 0)):
    jobs = [{"job": f"job-{c}"} for c in "abcd"]
    return {"mix": mix, "duty_cycle_nvml": nvml, "jobs": jobs, "exit_codes": list(codes),
            "vs_standalone": {"wall": wall, **{j["job"]: {"tokens_per_s": t, "samples_per_s": s}
                                               for j, t, s in zip(jobs, tok, smp)}},
            "degradation": {j["job"]: {"losses_identical": ok, "weights_identical": True} for j in jobs}}


def test_the_bound_is_n_times_the_standalone_duty_capped_at_one():
    base = {"duty_cycle_nvml": 0.2, "duty_cycle_phases": 0.3}
    r = regime(0.72, [0.97, 0.96, 0.99, 1.0], [0.99, 0.95, 1.0, 1.0], 0.4)
    f = D.figures(r, base, 4)
    assert f["bound"] == 0.8 and f["nvml_vs_bound"] == 0.9 and f["standalone_duty_from"] == "nvml"
    assert f["min_tokens_x"] == 0.96 and f["min_samples_x"] == 0.95 and f["wall_x"] == 0.4
    assert D.figures(r, {"duty_cycle_nvml": 0.4}, 4)["bound"] == 1.0
    assert D.figures(r, {"duty_cycle_nvml": None, "duty_cycle_phases": 0.1}, 4)["standalone_duty_from"] == "phases"


def test_the_targets_of_a_none_mix_each_with_its_verdict():
    base = {"duty_cycle_nvml": 0.2}
    good = regime(0.72, [0.97] * 4, [0.96] * 4, 0.4)
    bad = regime(0.5, [0.9] * 4, [0.96] * 4, 0.4, ok=False, codes=(0, 1, 0, 0))
    half = regime(0.9, [1.0] * 4, [1.0] * 4, 0.4, mix="half")
    doc = {"regimes": {"none/exclusive": {**good, "density": D.figures(good, base, 4)},
                       "none/fit": {**bad, "density": D.figures(bad, base, 4)},
                       "half/fit": {**half, "density": D.figures(half, base, 4)}}}
    got = {(t["mix"], t["what"]): t["ok"] for t in D.targets(doc, "trl")}
    assert all(v for (m, _), v in got.items() if m == "none/exclusive")
    assert not got[("none/fit", "nvml")] and not got[("none/fit", "min_tokens_x")]
    assert not got[("none/fit", "bit_identical")] and not got[("none/fit", "exit_codes")]
    assert not any(m == "half/fit" for m, _ in got)                  # only where one job fits at a time
    plain = {(t["what"]): t["ok"] for t in D.targets(doc, "plain") if t["mix"] == "none/exclusive"}
    assert plain == {"wall_x": True, "min_tokens_x": True, "bit_identical": True, "exit_codes": True}


def hold(g, r):
    return {"ev": "hold", "t_req": g, "t_grant": g, "t_release": r}


def test_advise_is_checked_after_the_warm_up_against_the_holds_and_the_steps():
    # Two jobs alternating, 1 s holds, 1 s gaps: the GPU always held, each step 2 s; alone, 2 s too.
    a = {"job": "job-a", "events": [hold(2 * i, 2 * i + 1) for i in range(6)]}
    b = {"job": "job-b", "events": [hold(2 * i + 1, 2 * i + 2) for i in range(6)]}
    alone = [{"job": "standalone", "events": [hold(2 * i, 2 * i + 1) for i in range(6)]}] * 2
    profs = [JobProfile(job=j, group="gpu", hold_ms=[1000] * 6, gap_ms=[1000] * 6, wait_ms=[0] * 6,
                        busy_ms=[1000] * 6, snapshot_ms=[10] * 3, restore_ms=[10] * 3,
                        gpu_bytes={"n/gpu-0": 40 * MiB}, device_bytes=40 * MiB) for j in ("job-a", "job-b")]
    ps = ProfileSet(profs, [GpuSet("gpu", [("n", [0])])],
                    [NodeInfo("n", 1 << 40, [{"id": "gpu-0", "index": 0, "total_bytes": 64 * MiB}])])
    got = D.advice(ps, [a, b], alone)
    assert got["jobs"] == ["job-a", "job-b"] and got["measured_held_duty"] == 1.0
    assert {v["measured"] for v in got["slowdown"].values()} == {0.0}
    assert 0 < got["predicted_duty"] <= 1 and got["duty_error_points"] == round(abs(got["predicted_duty"] - 1) * 100, 1)
    assert "error" in D.advice(ProfileSet([], [], []), [a, b], alone)
