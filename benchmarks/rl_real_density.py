"""How dense gpu_rl_real's N-job mixes were (sans-IO): what a mix reached against what it could
reach, whether the targets were met, and advise's prediction of the mix against what ran.

* **bound**: N jobs whose GPU phases keep the GPU busy a share d of the time alone reach at most
  min(1, N x d) (d: the standalone runs' NVML duty; their phase duty where there is no NVML);
* **figures** per sliced regime: NVML duty, its ratio to the bound, each job's GPU-phase
  throughput against its standalone run (the lowest tokens/s and samples/s ratio), the wall
  against one after the other;
* **targets** (``TARGETS``, per kind of job), checked on the mixes where one job fits at a time
  (``--mix none``: every handoff moves memory), with bit-identity and every exit code 0;
* **advice**: ``timeslice.advise``'s simulation of the group, from the profiles lockd recorded in
  that very regime (its control-plane cost not calibrated on it: the default), against the
  measured duty of the holds and each job's slowdown after the warm-up (``advice``).
"""
from __future__ import annotations

from benchmarks.rl_real_figures import holds
from timeslice.lockd.report.figures import union_length

#: what each kind of job's --mix none regimes must show (figure, comparison, bound)
TARGETS = {
    "trl": [("nvml", ">=", 0.70), ("nvml_vs_bound", ">=", 0.85), ("min_tokens_x", ">=", 0.95),
            ("min_samples_x", ">=", 0.95)],
    "plain": [("wall_x", "<=", 0.6), ("min_tokens_x", ">=", 0.97)],
}


def figures(reg: dict, base: dict, n: int) -> dict:
    """One sliced regime against the standalone baseline of the same run."""
    alone = base.get("duty_cycle_nvml")
    d = alone if alone is not None else base.get("duty_cycle_phases")
    bound = min(1.0, n * d) if d else None
    nvml = reg.get("duty_cycle_nvml")
    ratios = reg.get("vs_standalone") or {}
    tok = [ratios.get(j["job"], {}).get("tokens_per_s") for j in reg.get("jobs", [])]
    smp = [ratios.get(j["job"], {}).get("samples_per_s") for j in reg.get("jobs", [])]
    return {"standalone_duty": d, "standalone_duty_from": "nvml" if alone is not None else "phases",
            "bound": round(bound, 3) if bound else None, "nvml": nvml,
            "nvml_vs_bound": round(nvml / bound, 3) if nvml is not None and bound else None,
            "min_tokens_x": min((x for x in tok if x), default=None),
            "min_samples_x": min((x for x in smp if x), default=None),
            "wall_x": ratios.get("wall")}


def targets(doc: dict, kind: str) -> list[dict]:
    """The targets of ``kind`` on every regime of a --mix none run, each with its value and verdict."""
    out = []
    for key, r in doc["regimes"].items():
        if r.get("mix") != "none" or "error" in r or "skipped" in r or "density" not in r:
            continue
        dens = r["density"]
        for what, op, bound in TARGETS.get(kind, []):
            v = dens.get(what)
            ok = None if v is None else (v >= bound if op == ">=" else v <= bound)
            out.append({"mix": key, "what": what, "value": v, "target": f"{op} {bound}", "ok": ok})
        deg = r.get("degradation") or {}
        out.append({"mix": key, "what": "bit_identical", "value": bool(deg) and all(
            v["losses_identical"] and v["weights_identical"] for v in deg.values()), "target": "== True",
            "ok": bool(deg) and all(v["losses_identical"] and v["weights_identical"] for v in deg.values())})
        codes = r.get("exit_codes") or []
        out.append({"mix": key, "what": "exit_codes", "value": codes, "target": "all 0",
                    "ok": bool(codes) and all(c == 0 for c in codes)})
    return out


def _cycles(doc: dict, after: float) -> float | None:
    """The job's mean time from one release of the GPU to its next, for releases after ``after``:
    its step as the lock sees it (a GPU phase, a CPU phase, its wait), as advise simulates it."""
    rel = sorted(h["t_release"] for h in holds(doc) if h["t_release"] >= after)
    steps = [b - a for a, b in zip(rel, rel[1:])]
    return sum(steps) / len(steps) if steps else None


def advice(ps, docs: list[dict], alone: list[dict]) -> dict:
    """advise's prediction of this group (``ps``: lockd's profiles of it) against what ran, both after
    the warm-up as the simulation counts it (from the moment every job has released the GPU once):
    the duty of the holds, and each job's slowdown (its mean release-to-release step against its
    standalone run's, less one)."""
    from timeslice.advise.grouping import Advisor
    adv = Advisor(ps)
    names = tuple(sorted(n for n in adv.jobs if any(d["job"] == n for d in docs)))
    if len(names) < 2:
        return {"error": f"profiles of {len(names)} of the jobs (too few phases recorded)"}
    cand = adv.evaluate(names)
    warm = max(min(h["t_release"] for h in holds(d)) for d in docs)
    end = max(h["t_release"] for d in docs for h in holds(d))
    held = union_length([(max(h["t_grant"], warm), h["t_release"]) for d in docs for h in holds(d)
                         if h["t_release"] > warm])
    duty = held / (end - warm) if end > warm else None
    slow = {}
    for d, a in zip(docs, alone):
        mine = _cycles(d, warm)
        base = _cycles(a, min((h["t_release"] for h in holds(a)), default=0.0))
        if d["job"] in cand.result.jobs and mine and base:
            slow[d["job"]] = {"predicted": round(cand.result.jobs[d["job"]].slowdown, 3),
                              "measured": round(mine / base - 1, 3)}
    errs = [abs(v["predicted"] - v["measured"]) * 100 for v in slow.values()]
    return {"jobs": list(names), "overhead_s": adv.overhead_s, "predicted_duty": round(cand.duty, 3),
            "measured_held_duty": round(duty, 3) if duty is not None else None,
            "duty_error_points": round(abs(cand.duty - duty) * 100, 1) if duty is not None else None,
            "slowdown": slow, "slowdown_error_points_max": round(max(errs), 1) if errs else None}


def text(doc: dict) -> list[str]:
    lines = []
    for key, r in doc["regimes"].items():
        dens, adv = r.get("density"), r.get("advice")
        if dens:
            lines.append(f"density {key}: NVML {dens['nvml']} against the bound min(1, N x {dens['standalone_duty']}) "
                         f"= {dens['bound']} ({dens['nvml_vs_bound']}); GPU phases x standalone: tokens/s "
                         f">= {dens['min_tokens_x']}, samples/s >= {dens['min_samples_x']}; wall x{dens['wall_x']}")
        if adv and "error" not in adv:
            lines.append(f"advise {key}: predicted duty {adv['predicted_duty']} against held {adv['measured_held_duty']} "
                         f"({adv['duty_error_points']} points); slowdown predicted/measured " + ", ".join(
                             f"{j} {v['predicted']:+.2f}/{v['measured']:+.2f}" for j, v in adv["slowdown"].items()))
    return lines
