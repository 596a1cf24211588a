"""What a time-sliced regime of gpu_rl_real did, in time (sans-IO, from the jobs' documents).

* **order**: every hold of every job by grant time: the jobs' order (``"abcabc..."``, one letter per
  hold), and the FIFO check: a hold granted while another job had been waiting longer (by more than
  ``tolerance_s``: the request times are the jobs' own clocks, taken before their Acquire RPCs) is an
  inversion, unless its grant says it was a backfill (a fit group's, beside the head);
* **waits**: per job, how long each of its requests waited for its grant (count, mean, max, total);
* **beside**: each GPU-phase span (``generate``) of a job against the same span of its standalone
  run (tokens/s, the i-th span of one against the i-th of the other), and the share of it that
  overlapped what could slow it: another job's **swap** (a pause or resume its cooperative worker
  timed: copies on the host link), a **pin** (a host backup reservation, this job's own included:
  page faults and registration on the host), another job's **cpu** phase (its rewards: cores and
  memory bandwidth), another job's **gpu** phase (side by side, in a fit group). The summary gives,
  per cause, the median ratio of the spans it touched against the spans it did not: where a
  shortfall of the GPU phases beside others comes from.
"""
from __future__ import annotations

import statistics

from benchmarks.rl_real_figures import busy_intervals, holds, overlap, spans

CAUSES = ("swap", "pin", "cpu", "gpu")
TOUCHED = 0.05                    # a span counts as touched by a cause over this share of its length


def job_letter(doc: dict) -> str:
    job = str(doc.get("job", "?"))
    return job.rsplit("-", 1)[-1][:1] or "?"


def order(docs: list[dict], tolerance_s: float = 0.05) -> dict:
    """The grant order of one regime and its FIFO inversions."""
    hs = sorted(((h, job_letter(d)) for d in docs for h in holds(d)), key=lambda x: x[0]["t_grant"])
    inversions = []
    for i, (h, who) in enumerate(hs):
        if h.get("backfilled"):
            continue
        older = [(o, w) for o, w in hs[i + 1:] if o["t_req"] < h["t_req"] - tolerance_s and o["t_req"] <= h["t_grant"]]
        if older:
            o, w = min(older, key=lambda x: x[0]["t_req"])
            inversions.append({"granted": who, "at": round(h["t_grant"], 3), "waited_longer": w,
                               "by_s": round(h["t_req"] - o["t_req"], 3)})
    return {"order": "".join(w for _, w in hs), "holds": len(hs), "fifo_inversions": len(inversions),
            "inversions": inversions[:20], "tolerance_s": tolerance_s}


def waits(docs: list[dict]) -> dict:
    out = {}
    for d in docs:
        w = [max(0.0, h["t_grant"] - h["t_req"]) for h in holds(d)]
        out[d["job"]] = {"n": len(w), "mean_s": round(statistics.fmean(w), 3) if w else 0.0,
                         "max_s": round(max(w), 3) if w else 0.0, "total_s": round(sum(w), 3)}
    return out


def _windows(doc: dict) -> dict[str, list[tuple[float, float]]]:
    """What of this job could slow another's GPU phase, as time intervals, per cause."""
    ops = [(float(o[1]), float(o[2])) for o in doc.get("ops") or [] if o[0] in ("pause", "resume")]
    pins = [(float(p[0]), float(p[1])) for p in (doc.get("pin") or {}).get("windows") or []]
    return {"swap": ops, "pin": pins, "cpu": [(e["start"], e["end"]) for e in spans(doc, gpu=False)],
            "gpu": _clip(busy_intervals(doc), [(h["t_grant"], h["t_release"]) for h in holds(doc)])}


def _clip(ivs: list[tuple[float, float]], within: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``ivs`` cut to ``within``: a GPU span that holds the group only part of its length (a TRL step
    waits for its next grant inside its span, after its rewards) ran on the GPU only while held."""
    return [(max(a, s), min(b, e)) for a, b in ivs for s, e in within if min(b, e) > max(a, s)]


def beside(docs: list[dict], alone: list[dict], phase: str = "generate") -> dict:
    """Per job, each ``phase`` span's tokens/s against its standalone twin, and what overlapped it."""
    wins = [_windows(d) for d in docs]
    jobs, rows = {}, []
    for k, (d, a) in enumerate(zip(docs, alone)):
        mine, twins = spans(d, phase), spans(a, phase)
        out = []
        for i, (e, t) in enumerate(zip(mine, twins)):
            length = e["end"] - e["start"]
            rate = e.get("tokens", 0) / length if length > 0 else 0.0
            base = t.get("tokens", 0) / (t["end"] - t["start"]) if t["end"] > t["start"] else 0.0
            share = {}
            for c in CAUSES:
                ivs = [iv for j, w in enumerate(wins) for iv in w[c] if j != k or c == "pin"]
                share[c] = round(overlap((e["start"], e["end"]), ivs) / length, 3) if length > 0 else 0.0
            row = {"i": i, "s": round(length, 3), "ratio": round(rate / base, 3) if base else None, **share}
            out.append(row)
            rows.append(row)
        ratios = [r["ratio"] for r in out if r["ratio"] is not None]
        jobs[d["job"]] = {"spans": out, "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
                          "after_first": round(statistics.median(ratios[1:]), 3) if len(ratios) > 1 else None}
    summary = {}
    for c in CAUSES:
        hit = [r["ratio"] for r in rows if r["ratio"] is not None and r[c] > TOUCHED]
        clean = [r["ratio"] for r in rows if r["ratio"] is not None and r[c] <= TOUCHED]
        summary[c] = {"touched": len(hit), "median_ratio_touched": round(statistics.median(hit), 3) if hit else None,
                      "median_ratio_untouched": round(statistics.median(clean), 3) if clean else None}
    return {"phase": phase, "jobs": jobs, "by_cause": summary}


def timeline(docs: list[dict], alone: list[dict]) -> dict:
    """All of it for one regime."""
    return {"order": order(docs), "waits": waits(docs), "beside": beside(docs, alone)}


def text(tl: dict) -> str:
    """A few lines for the benchmark's report."""
    o = tl["order"]
    lines = [f"  order {o['order'][:80]}{'...' if len(o['order']) > 80 else ''} "
             f"({o['holds']} holds, FIFO inversions {o['fifo_inversions']})"]
    lines.append("  waits " + ", ".join(f"{j} {w['mean_s']:.2f}s mean / {w['max_s']:.2f}s max"
                                         for j, w in tl["waits"].items()))
    b = tl["beside"]
    lines.append(f"  {b['phase']} x standalone " + ", ".join(
        f"{j} {v['median_ratio']}" for j, v in b["jobs"].items()) + "; touched by " + ", ".join(
        f"{c} {s['touched']} ({s['median_ratio_touched']} vs {s['median_ratio_untouched']})"
        for c, s in b["by_cause"].items()))
    return "\n".join(lines)
