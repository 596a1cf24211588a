"""The demo's timeline picture (PNG, matplotlib's Agg backend: no display needed).

One panel per run, one row per job: GPU phases coloured (generate, train),
the CPU phase in grey, time spent waiting for the device hatched (in sliced
runs this includes the swap that made room), and every grant that moved bytes
marked with a red triangle (the MB moved beside it); an elided swap is a
green diamond. The panels share the time axis, so the baseline's length and
the time-sliced runs' can be compared at a glance. ``timeslice report`` draws a
live cluster's groups with it too (one panel per group, its holds as the phases:
``title`` and ``phases`` say so).
"""
from __future__ import annotations

from pathlib import Path

from timeslice.lockd.report.figures import RunFigures

COLORS = {"generate": "#1f77b4", "train": "#ff7f0e", "rewards": "#c7c7c7", "wait": "#f4cccc", "hold": "#1f77b4"}
DEMO_TITLE = "timeslice demo: two RL jobs, generate (GPU) -> rewards (CPU) -> train (GPU)"
DEMO_PHASES = (("generate", "generate (GPU)"), ("train", "train (GPU)"), ("rewards", "rewards (CPU)"))


def draw(runs: list[tuple[RunFigures, dict[str, list[dict]]]], path: str | Path, subtitle: str = "",
         title: str = DEMO_TITLE, phases: tuple[tuple[str, str], ...] = DEMO_PHASES,
         xlabel: str = "seconds since the jobs started") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    path = Path(path)
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(12, 1.2 + 1.8 * n), sharex=True, squeeze=False)
    xmax = max((fig_.wall_s for fig_, _ in runs), default=1.0)
    for ax, (fg, by_job) in zip(axes[:, 0], runs):
        labels = []
        for row, job in enumerate(sorted(by_job)):
            evs = by_job[job]
            y = len(by_job) - 1 - row
            label = next((e.get("label") for e in evs if e.get("label")), job)
            labels.append((y, label))
            for e in evs:
                if e.get("type") != "phase":
                    continue
                s, t = e["t_start"] - fg.t0, e["t_end"] - fg.t0
                if e.get("gpu") and "t_request" in e and e["t_start"] - e["t_request"] > 0.01:
                    w0 = e["t_request"] - fg.t0
                    ax.broken_barh([(w0, s - w0)], (y - 0.3, 0.6), facecolors=COLORS["wait"],
                                   edgecolor="#cc4125", hatch="///", linewidth=0)
                ax.broken_barh([(s, t - s)], (y - 0.3, 0.6), facecolors=COLORS.get(e["phase"], "#999999"),
                               edgecolor="white", linewidth=0.5)
                if e.get("gpu") and e.get("bytes_moved", 0) > 0:
                    ax.plot([s], [y + 0.42], marker="v", color="#d62728", markersize=7, zorder=5)
                    ax.annotate(_bytes(e["bytes_moved"]), (s, y + 0.42), xytext=(4, 1),
                                textcoords="offset points", fontsize=6.5, color="#d62728", va="bottom")
                elif e.get("gpu") and e.get("elided"):
                    ax.plot([s], [y + 0.42], marker="D", color="#2ca02c", markersize=5, zorder=5)
        ax.set_yticks([y for y, _ in labels], [lb for _, lb in labels])
        ax.set_ylim(-0.6, len(by_job) - 0.2)
        ax.set_xlim(0, xmax * 1.02)
        stats = f"GPU duty cycle {fg.duty:.0%} (busy {fg.gpu_busy_s:.1f}s of {fg.wall_s:.1f}s)"
        if fg.mode == "sliced":
            stats += f"; swaps {fg.swaps}, elided {fg.elided}, moved {_bytes(fg.bytes_moved)}"
        ax.set_title(f"{fg.title}\n{stats}", fontsize=9, loc="left")
        ax.grid(axis="x", linestyle=":", alpha=0.5)
    axes[-1, 0].set_xlabel(xlabel)
    handles = [*(Patch(facecolor=COLORS.get(ph, "#999999"), label=label) for ph, label in phases),
               Patch(facecolor=COLORS["wait"], edgecolor="#cc4125", hatch="///", label="waiting for the GPU (incl. swap)"),
               Line2D([], [], marker="v", color="#d62728", linestyle="", label="swap: context moved"),
               Line2D([], [], marker="D", color="#2ca02c", linestyle="", label="swap elided")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10.5)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
