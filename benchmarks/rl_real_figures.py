"""The figures of benchmarks/gpu_rl_real.py, from what its jobs wrote (sans-IO).

Each job (examples/grpo/trl_job.py) writes one document: exact per-step losses, the
final weights' sha256, and its event log (``timeslice.integrations.slicing.PhaseLog``):
every hold (``t_req``, ``t_grant``, ``t_release``, the grant's figures) and every phase
span (``generate`` with the tokens it made, ``train_step`` with the samples it trained,
``rollout``, ``optimizer``; ``rewards`` outside the hold), on the host's monotonic clock,
which all processes share. From them, per regime:

* the window: from the first acquire request of the first job to the last release of
  the last one (standalone: each job's own window, one after the other, summed);
* phase duty: the union of GPU spans, less the CPU spans inside them, over the window;
  held duty: the union of the holds; NVML duty (the headline) is the sampler's, over
  the same window, and is added by the caller;
* per job: steps, GPU-phase throughput (tokens/s inside ``generate``, samples/s inside
  the training part of ``train_step`` plus the optimizer step), first-pin time, the
  residue its worker measured after each pause;
* the degradation check against the standalone documents of the same run.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable

from timeslice.lockd.report.figures import union_length

GiB = float(1 << 30)


def spans(doc: dict, name: str | None = None, gpu: bool | None = None) -> list[dict]:
    return [e for e in doc["events"] if e["ev"] == "span" and (name is None or e["name"] == name)
            and (gpu is None or bool(e.get("gpu")) == gpu)]


def holds(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["ev"] == "hold"]


def window(doc: dict) -> tuple[float, float]:
    hs = holds(doc)
    return min(h["t_req"] for h in hs), max(h["t_release"] for h in hs)


def overlap(a: tuple[float, float], others: Iterable[tuple[float, float]]) -> float:
    return union_length([(max(a[0], s), min(a[1], e)) for s, e in others if min(a[1], e) > max(a[0], s)])


def busy_intervals(doc: dict) -> list[tuple[float, float]]:
    """GPU span time less the CPU spans nested in it (rewards inside a rollout)."""
    cpu = [(e["start"], e["end"]) for e in spans(doc, gpu=False)]
    out: list[tuple[float, float]] = []
    for e in spans(doc, gpu=True):
        cut = sorted((max(s, e["start"]), min(t, e["end"])) for s, t in cpu if min(t, e["end"]) > max(s, e["start"]))
        at = e["start"]
        for s, t in cut:
            if s > at:
                out.append((at, s))
            at = max(at, t)
        if e["end"] > at:
            out.append((at, e["end"]))
    return out


def throughput(doc: dict) -> dict:
    gen = spans(doc, "generate")
    gen_s = sum(e["end"] - e["start"] for e in gen)
    tokens = sum(e.get("tokens", 0) for e in gen)
    rollouts = [(e["start"], e["end"]) for e in spans(doc, "rollout")]
    train_s, samples = 0.0, 0
    for e in spans(doc, "train_step"):
        train_s += (e["end"] - e["start"]) - overlap((e["start"], e["end"]), rollouts)
        samples += e.get("samples", 0)
    opt = spans(doc, "optimizer")
    train_s += sum(e["end"] - e["start"] for e in opt)
    # The first step pins the new optimizer state's host backup inside its span (sliced runs
    # only): a one-time cost, reported as first-pin time, not as training throughput.
    train_s -= sum(e.get("pin_s", 0) for e in doc["events"] if e["ev"] == "region"
                   and any(o["start"] <= e["t"] <= o["end"] for o in opt))
    return {"tokens": tokens, "generate_s": round(gen_s, 3),
            "tokens_per_s": round(tokens / gen_s, 2) if gen_s else 0.0,
            "samples": samples, "train_s": round(train_s, 3),
            "samples_per_s": round(samples / train_s, 3) if train_s else 0.0}


def job_figures(doc: dict) -> dict:
    t0, t1 = window(doc)
    reg = [e for e in doc["events"] if e["ev"] == "registered"]
    pins = [e for e in doc["events"] if e["ev"] == "region" and e.get("tag") != "weights"]
    hs = holds(doc)
    residues = doc.get("residues") or []
    return {"job": doc["job"], "steps": doc["steps"], "window_s": round(t1 - t0, 2), **throughput(doc),
            "holds": len(hs), "restored": sum(bool(h["restored"]) for h in hs),
            "elided": sum(bool(h["elided"]) for h in hs),
            "waited_s": round(sum(h["waited_ms"] for h in hs) / 1000, 2),
            "first_pin_s": round(sum(e.get("seconds", 0) for e in reg) + sum(e.get("pin_s", 0) for e in pins), 3),
            "region_bytes": doc.get("region_bytes", {}), "host_bytes": doc.get("host_bytes", 0),
            "peak_bytes": doc.get("peak_bytes", 0), "worker_swaps": doc.get("swaps", 0),
            "residue_bytes_max": max(residues) if residues else None,
            "residue_bytes_median": int(statistics.median(residues)) if residues else None,
            "nondeterminism_warnings": doc.get("warnings", [])}


def regime_figures(docs: list[dict], sequential: bool = False) -> dict:
    """Duty cycles and per-job figures of one regime (``sequential``: the standalone baseline)."""
    wins = [window(d) for d in docs]
    if sequential:
        wall = sum(t1 - t0 for t0, t1 in wins)
        busy = sum(union_length(busy_intervals(d)) for d in docs)
        held = sum(union_length([(h["t_grant"], h["t_release"]) for h in holds(d)]) for d in docs)
        t0, t1 = wins[0][0], wins[-1][1]
    else:
        t0, t1 = min(w[0] for w in wins), max(w[1] for w in wins)
        wall = t1 - t0
        busy = union_length([iv for d in docs for iv in busy_intervals(d)])
        held = union_length([(h["t_grant"], h["t_release"]) for d in docs for h in holds(d)])
    # Steady state: after every job's first optimizer step (model load, first pin, state creation).
    firsts = [min((e["end"] for e in spans(d, "optimizer")), default=t1) for d in docs]
    s0 = max(firsts)
    steady_busy = union_length([(max(s, s0), e) for d in docs for s, e in busy_intervals(d) if e > s0])
    steady_wall = t1 - s0 if not sequential else sum(max(0.0, w[1] - f) for w, f in zip(wins, firsts))
    if sequential:
        steady_busy = sum(union_length([(max(s, f), e) for s, e in busy_intervals(d) if e > f])
                          for d, f in zip(docs, firsts))
    return {"t0": t0, "t1": t1, "windows": [list(w) for w in wins], "wall_s": round(wall, 2),
            "duty_cycle_phases": round(busy / wall, 3) if wall else 0.0,
            "duty_cycle_held": round(held / wall, 3) if wall else 0.0,
            "duty_cycle_phases_steady": round(steady_busy / steady_wall, 3) if steady_wall > 0 else 0.0,
            "steady_window_s": round(steady_wall, 2), "steady_from": s0, "steady_froms": firsts,
            "jobs": [job_figures(d) for d in docs]}


def degradation(sliced: list[dict], alone: list[dict]) -> dict:
    """Per job: losses and final weights bit-identical to the standalone run of the same job."""
    out = {}
    for s, a in zip(sliced, alone):
        out[s["job"]] = {"losses_identical": s["losses"] == a["losses"], "weights_identical": s["digest"] == a["digest"],
                         "steps": [s["steps"], a["steps"]], "digest": s["digest"][:16],
                         "first_loss_diff": next(([i, x, y] for i, (x, y) in enumerate(zip(s["losses"], a["losses"]))
                                                  if x != y), None)}
    return out


def ratios(reg: dict, base: dict) -> dict:
    """Against the standalone baseline of the same run: duty cycles and each job's throughput."""
    out: dict = {}
    for key in ("duty_cycle_nvml", "duty_cycle_phases", "duty_cycle_phases_steady", "duty_cycle_nvml_steady"):
        if reg.get(key) is not None and base.get(key):
            out[key] = round(reg[key] / base[key], 3)
    if base.get("wall_s"):
        out["wall"] = round(reg["wall_s"] / base["wall_s"], 3)
    for j, b in zip(reg["jobs"], base["jobs"]):
        out[j["job"]] = {k: round(j[k] / b[k], 3) if b[k] else None for k in ("tokens_per_s", "samples_per_s")}
    return out


def swap_figures(ops: dict, docs: list[dict]) -> dict:
    """The agent's snapshot/restore ops of one regime (gpu_timeslice.agent_ops) in GiB and seconds."""
    snaps = [o for o in ops.get("op_list", []) if o[0] == "snapshot" and o[3]]
    return {"swaps": len(snaps), "gib_per_swap": round(statistics.mean(o[3] for o in snaps) / GiB, 3) if snaps else 0.0,
            "round_trip_first_s": ops.get("round_trip_first_s"),
            "round_trip_steady_median_s": ops.get("round_trip_steady_median_s"),
            "op_seconds": ops.get("op_seconds", 0.0),
            "residue_gib_max": max((j["residue_bytes_max"] or 0 for j in map(job_figures, docs)), default=0) / GiB}


def sharing_figures(docs: list[dict], capacity: dict[str, int] | None = None, margin: int = 0) -> dict:
    """How one regime's holds overlapped (each job's ``hold`` events, as its integration saw them:
    from its Acquire returning to its Yield call): the most jobs holding at once, the time two or
    more held, holds begun beside another, backfills; with the GPUs' ``capacity`` ("<node>/<GPU>"
    -> bytes), the holds begun while those in progress weighed more than a GPU has less ``margin``,
    and those begun beside a hold that weighed the whole device (either way round)."""
    ivs = [(h["t_grant"], h["t_release"], h) for d in docs for h in holds(d)]
    order = sorted([(s, 1, i) for i, (s, _, _) in enumerate(ivs)] + [(e, 0, i) for i, (_, e, _) in enumerate(ivs)])
    open_: set[int] = set()
    most, beside, over, alone_broken = 0, 0, 0, 0
    shared: list[tuple[float, float]] = []
    since = None
    for t, kind, i in order:                       # at one instant a release (0) comes before a grant (1)
        if kind == 0:
            open_.discard(i)
            if len(open_) < 2 and since is not None:
                shared.append((since, t))
                since = None
            continue
        if open_:
            beside += 1
            whole = [j for j in (*open_, i) if ivs[j][2].get("exclusive") or not ivs[j][2].get("footprint")]
            alone_broken += bool(whole)
            if capacity is not None:
                load: dict[str, int] = {}
                for j in (*open_, i):
                    for slot, b in (ivs[j][2].get("footprint") or {}).items():
                        load[slot] = load.get(slot, 0) + int(b)
                over += any(slot not in capacity or b > capacity[slot] - margin for slot, b in load.items())
        open_.add(i)
        most = max(most, len(open_))
        if len(open_) >= 2 and since is None:
            since = t
    return {"max_holders": most, "shared_s": round(union_length(shared), 3), "holds_beside_another": beside,
            "backfilled": sum(bool(h.get("backfilled")) for _, _, h in ivs),
            "exclusive_beside_another": alone_broken, "over_capacity": over if capacity is not None else None}


def vs(reg: dict, ref: dict) -> dict:
    """A regime against another of the same run (the nolock one): wall and duty cycles as ratios."""
    out: dict = {"wall": round(reg["wall_s"] / ref["wall_s"], 3) if ref.get("wall_s") else None}
    for key in ("duty_cycle_nvml", "duty_cycle_nvml_steady", "duty_cycle_phases"):
        if reg.get(key) is not None and ref.get(key):
            out[key] = round(reg[key] / ref[key], 3)
    return out
