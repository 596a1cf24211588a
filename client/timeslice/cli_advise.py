"""The placement subcommands: ``timeslice profile [JOB]`` and ``timeslice advise``.

``profile`` shows what lockd recorded of each job's phases per group (hold,
gap and wait times, swap costs, footprint) and, with ``--json``, writes the
file ``advise --from`` reads. ``advise`` proposes which jobs should share which
GPUs (timeslice.advise.grouping), prints the predicted duty cycle and each
job's predicted slowdown for the proposal and for today's grouping, and with
``--apply`` creates the proposed groups (admin token).
"""
from __future__ import annotations

import argparse
import json
import sys

from timeslice.advise.grouping import DEFAULT_MAX_SLOWDOWN, Advice, Candidate, Options, advise
from timeslice.advise.profile import JobProfile, ProfileFormatError, ProfileSet, mean, pct
from timeslice.cli import admin_client
from timeslice.common.cliout import emit
from timeslice.errors import InvalidArgumentError

MAX_FILE_BYTES = 64 << 20


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("profile", parents=[common],
                       help="each job's recorded phases per group: hold, gap, wait, swaps, footprint")
    p.add_argument("job", nargs="?", default="", help="only this job (default: every job)")
    p.add_argument("--group", default="", help="only this group")
    p.set_defaults(func=cmd_profile)

    a = sub.add_parser("advise", parents=[common],
                       help="propose which jobs should share GPUs, with the predicted duty cycle and slowdowns")
    a.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                   help="plan with profiles from FILE (written by `timeslice profile --json`) instead of lockd's")
    a.add_argument("--max-slowdown", type=float, default=DEFAULT_MAX_SLOWDOWN, metavar="FRACTION",
                   help="bound on each job's predicted slowdown over its solo step")
    a.add_argument("--max-group-size", type=int, default=3, choices=(1, 2, 3, 4),
                   help="most jobs in one group")
    a.add_argument("--overhead-ms", type=float, default=None,
                   help="control-plane cost of a grant or swap step (default: calibrated on today's waits)")
    a.add_argument("--assume-gbps", type=float, default=10.0, metavar="GB/S",
                   help="host<->device copy rate assumed for swaps when no job's swap was recorded")
    a.add_argument("--seed", type=int, default=0, help="seed of the simulation's draws")
    a.add_argument("--apply", action="store_true",
                   help="create the proposed groups (admin token), named --name-prefix N")
    a.add_argument("--name-prefix", default="advised-", help="names of the groups --apply creates")
    a.set_defaults(func=cmd_advise)


def _fetch(args, job: str = "", group: str = "") -> ProfileSet:
    with admin_client(args) as c:
        return c.profiles(job, group)


def cmd_profile(args) -> int:
    ps = _fetch(args, args.job, args.group)
    emit(args, ps.to_dict(), lambda: profile_table(ps.profiles))
    return 0


def _ms(xs: list[int]) -> str:
    return f"{mean(xs):.0f}/{pct(xs, 0.9):.0f}" if xs else "-"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}M" if n else "-"


def profile_table(profiles: list[JobProfile]) -> str:
    if not profiles:
        return "no profiles recorded yet (a job's phases appear after its first yields)"
    head = ("JOB", "GROUP", "N", "HOLD ms", "GAP ms", "WAIT ms", "SNAP ms", "RESTORE ms", "GPU MEM", "BUSY", "WAIT",
            "LIVE")
    rows = [head]
    for p in profiles:
        rows.append((p.job, p.group, str(len(p.hold_ms)), _ms(p.hold_ms), _ms(p.gap_ms), _ms(p.wait_ms),
                     _ms(p.snapshot_ms), _ms(p.restore_ms), _mib(p.per_gpu_bytes), f"{p.busy_fraction:.0%}",
                     f"{p.wait_fraction:.0%}", "yes" if p.live else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n(ms: mean/p90 of the last phases; BUSY, WAIT: share of the job's cycle)"


def _load(path: str) -> ProfileSet:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise InvalidArgumentError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        return ProfileSet.from_dict(json.loads(raw))
    except (ValueError, ProfileFormatError) as e:
        raise InvalidArgumentError(f"{path}: {e}") from None


def cmd_advise(args) -> int:
    ps = _load(args.from_file) if args.from_file else _fetch(args)
    try:
        opts = Options(max_slowdown=args.max_slowdown, max_group_size=args.max_group_size, seed=args.seed,
                       gbps=args.assume_gbps,
                       overhead_s=None if args.overhead_ms is None else args.overhead_ms / 1000)
    except ValueError as e:
        print(f"timeslice: error: {e}", file=sys.stderr)
        return 2
    adv = advise(ps, opts)
    names = {pl.jobs: f"{args.name_prefix}{i + 1}" for i, pl in enumerate(adv.proposal.groups)}
    doc = adv.to_dict()
    for g, pl in zip(doc["proposal"]["groups"], adv.proposal.groups, strict=True):
        g["name"] = names[pl.jobs]
    created = []
    if args.apply:
        if args.from_file:
            print("timeslice: error: --apply writes this cluster's groups; it needs live profiles, not --from",
                  file=sys.stderr)
            return 2
        created = _apply(args, ps, adv, names)
        doc["created"] = created
    emit(args, doc, lambda: advice_text(adv, names, args.max_slowdown, created))
    return 0


def _apply(args, ps: ProfileSet, adv: Advice, names: dict[tuple[str, ...], str]) -> list[str]:
    sets = {g.group: g for g in ps.groups}
    made = []
    with admin_client(args) as c:
        for pl in adv.proposal.groups:
            src = sets.get(pl.gpu_set)
            if src is None:
                continue                      # no GPU set free for it: said in the text
            c.create_group(names[pl.jobs], [(n, list(g)) for n, g in src.nodes])
            made.append(names[pl.jobs])
    return made


def _row(name: str, pl: Candidate, where: str) -> str:
    slow = "  ".join(f"{j} {round(pl.result.jobs[j].slowdown, 4) + 0.0:+.1%}" for j in pl.jobs)
    return f"  {name:<14} {pl.duty:6.1%}  {slow}{where}"


def advice_text(adv: Advice, names: dict[tuple[str, ...], str], bound: float, created: list[str]) -> str:
    p, t = adv.proposal, adv.today
    out = [f"proposal: {len(p.groups)} group(s) on {p.gpus} GPU(s), predicted duty cycle {p.duty:.1%}; "
           f"today: {len(t.groups)} group(s) on {t.gpus} GPU(s), predicted {t.duty:.1%} "
           f"(gain {p.duty - t.duty:+.1%}; slowdown bound {bound:.0%})",
           "  GROUP            DUTY  PREDICTED SLOWDOWN (vs the job alone)"]
    for pl in p.groups:
        out.append(_row(names[pl.jobs], pl, (f"   GPUs of {pl.gpu_set}" if pl.gpu_set else "   (no GPU set free)")
                        + ("" if pl.feasible else f"   ! {pl.why}: no better grouping fits the GPU sets")))
    if adv.kept:
        out.append(f"keep today's grouping: {adv.kept}")
    out.append("today:")
    for pl in t.groups:
        out.append(_row(pl.gpu_set, pl, "" if pl.feasible else f"   ! {pl.why}"))
    if adv.skipped:
        out.append(f"not planned (too few phases recorded): {', '.join(adv.skipped)}")
    if adv.estimated:
        out.append(f"never swapped, swap time estimated ({adv.rate}): {', '.join(adv.estimated)}")
    out.append(f"(simulated with the jobs' recorded phases; control-plane cost {adv.overhead_s * 1000:.1f} ms "
               "per grant or swap step)")
    if created:
        out.append(f"created: {', '.join(created)} — restart each job with its new group id")
    return "\n".join(out)
