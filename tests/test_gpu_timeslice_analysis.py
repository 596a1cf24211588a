"""benchmarks/gpu_timeslice.py's figures without a GPU: pinning and waiting are never GPU time, the wall starts
when the jobs start (start-up and pinning count), and the pair is compared with one after the other."""
from __future__ import annotations

from benchmarks import gpu_timeslice as gts


class Samples:
    """NVML samples as the sampler keeps them: (time, util %, used bytes)."""

    def __init__(self, samples):
        self.samples = samples

    mean_util = gts.NvmlSampler.mean_util


def phase(job, name, t_req, start, end, spans=None, **kw):
    e = {"ev": "phase", "job": job, "phase": name, "gpu": True, "t_req": t_req, "start": start, "end": end,
         "checksum_ok": True, "token": kw.pop("token", 1), **kw}
    if spans:
        e["gpu_spans"] = spans
    return e


def test_pinning_inside_a_hold_and_waiting_are_not_gpu_time_and_the_wall_starts_at_the_jobs_start():
    events = [
        {"ev": "start", "job": "a", "t": 0.0},
        {"ev": "pinned", "job": "a", "start": 0.5, "end": 2.5, "method": "thp"},     # before any hold
        phase("a", "generate", 3.0, 3.0, 10.0, spans=[[3.0, 4.0], [8.0, 10.0]]),    # 4 s of pinning inside
        phase("a", "train", 10.0, 12.0, 14.0, token=2),                            # waited 2 s for the grant
    ]
    r = gts.analyse(events, Samples([(t, 50, 0) for t in range(0, 15)]), "x")
    assert r["wall_s"] == 14.0 and r["phases_wall_s"] == 11.0
    assert r["gpu_busy_s"] == 5.0 and r["duty_cycle_phases"] == round(5 / 14, 3)
    assert r["pinning_inside_holds_s"] == 4.0 and r["pin_s"] == {"a": 2.0}
    assert r["duty_cycle_nvml"] == 0.5


def test_the_pair_is_compared_with_one_after_the_other():
    rows = gts.compare([{"label": "standalone (one after the other)", "wall_s": 100.0, "e2e_wall_s": 110.0,
                         "duty_cycle_nvml": 0.5},
                        {"label": "time-sliced, nofit-coop", "wall_s": 70.0, "e2e_wall_s": 77.0,
                         "duty_cycle_nvml": 0.8}])
    assert rows == [{"label": "time-sliced, nofit-coop", "wall_vs_one_after_the_other": 0.7,
                     "e2e_wall_vs_one_after_the_other": 0.7, "nvml_duty": 0.8, "nvml_duty_one_after_the_other": 0.5}]


def test_the_named_profile_of_the_40_gib_long_regime():
    p = gts.PROFILES["40g_long"]
    assert (p["mem_gb"], p["gen_s"], p["train_s"], p["iters"], p["regimes"]) == (40.0, 6.0, 6.0, 3, "nofit-coop")


def test_a_run_in_which_a_job_died_is_failed_and_has_no_ratio():
    """The issue's H200 run: job-a died at its first generate (exit code 1) and the run printed a
    'wall x0.50' that meant nothing. A job that died, in the pair or in the baseline, fails the run."""
    base = {"label": "standalone (one after the other)", "wall_s": 100.0, "duty_cycle_nvml": 0.5,
            "violations": [], "job_exit_codes": [0, 0]}
    died = {"label": "time-sliced, nofit-coop", "wall_s": 50.0, "duty_cycle_nvml": 0.8,
            "violations": ["job exit codes [1, 0]"], "job_exit_codes": [1, 0]}
    [row] = gts.compare([base, died])
    assert row["failed"] and "wall_vs_one_after_the_other" not in row and row["why"] == ["job exit codes [1, 0]"]
    ok = {**died, "violations": [], "job_exit_codes": [0, 0]}
    [row] = gts.compare([{**base, "violations": ["job exit codes [0, 'timeout']"]}, ok])
    assert row["failed"]                                          # nor against a baseline whose job died
    [row] = gts.compare([base, ok])
    assert row["wall_vs_one_after_the_other"] == 0.5 and not row.get("failed")
    assert gts.failed({"violations": [], "job_exit_codes": ["timeout", 0]})
