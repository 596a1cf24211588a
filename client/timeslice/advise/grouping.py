"""Which jobs should share GPUs: groups (pairs, triples) that maximise the predicted duty cycle; sans-IO.

Every candidate group is judged by ``simulate`` (the scheduler's own rule
played forward with the members' recorded phases) on the GPUs it would get:
it is *feasible* when each member's predicted slowdown stays within
``max_slowdown`` of its solo step and, where the node's free host memory is
known, the snapshots of all members but one fit in it (while one job holds
the GPUs the others may all be parked). Jobs share a group only with jobs
that use as many GPUs (a group is one set of GPUs for all its jobs).

The search: every feasible group up to ``max_group_size`` jobs (triples only
over feasible pairs), a greedy packing (largest, then busiest groups first),
then local search — the union of any two groups is re-partitioned as well as
possible — until nothing improves the cluster duty cycle: the GPU-weighted
busy share of the GPU sets in use.

The control-plane cost of a grant or a swap step (etcd round trips) is not in
a profile; ``calibrate`` finds the one such cost that makes the simulation of
today's grouping wait as long as the jobs actually waited.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from timeslice.advise.profile import JobProfile, ProfileSet, mean
from timeslice.advise.simulate import DEFAULT_HANDOFF_S, SimGroup, SimJob, SimResult, simulate

DEFAULT_MAX_SLOWDOWN = 0.15
DEFAULT_MIN_GAIN = 0.005     # duty a proposal must gain over today's to be proposed (the simulation's spread)
DEFAULT_GBPS = 10.0          # copy rate assumed for a job never swapped when no job was (bytes / 1e9 per s)
# What lockd admits beyond a job's measured footprint by default (lockd/footprints.py, --footprint-margin):
# planned the same here, or two jobs the lock will not put side by side are simulated as fitting.
LOCKD_MARGIN_FRACTION = 0.02
MAX_IMPROVE_ROUNDS = 100


@dataclass(frozen=True)
class Options:
    max_slowdown: float = DEFAULT_MAX_SLOWDOWN
    max_group_size: int = 3
    overhead_s: float | None = None       # grant / swap-step control-plane cost; None: calibrate
    gbps: float = DEFAULT_GBPS
    cycles: int = 150
    seed: int = 0
    min_gain: float = DEFAULT_MIN_GAIN

    def __post_init__(self) -> None:
        if not 0 <= self.max_slowdown <= 10 or not 1 <= self.max_group_size <= 4:
            raise ValueError("max_slowdown must be in [0, 10] and max_group_size in [1, 4]")
        if self.gbps <= 0 or self.cycles < 10:
            raise ValueError("gbps must be > 0 and cycles >= 10")
        if not 0 <= self.min_gain <= 1:
            raise ValueError("min_gain must be in [0, 1]")


@dataclass
class Candidate:
    """One group of jobs on one set of GPUs, with its prediction."""

    jobs: tuple[str, ...]
    gpus: int
    result: SimResult
    feasible: bool
    why: str = ""
    gpu_set: str = ""                     # the existing group whose GPUs it would use ("" : none free)

    @property
    def duty(self) -> float:
        return self.result.duty

    def to_dict(self) -> dict:
        return {"jobs": list(self.jobs), "gpus": self.gpus, "duty": round(self.duty, 4),
                "feasible": self.feasible, "why": self.why, "gpu_set": self.gpu_set,
                "swaps": self.result.swaps, "elided": self.result.elided,
                "slowdown": {n: round(j.slowdown, 4) for n, j in self.result.jobs.items()},
                "wait_s": {n: round(j.mean_wait_s, 4) for n, j in self.result.jobs.items()}}


@dataclass
class Plan:
    groups: list[Candidate] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.groups)

    @property
    def duty(self) -> float:
        g = self.gpus
        return sum(p.gpus * p.duty for p in self.groups) / g if g else 0.0

    def slowdown(self) -> dict[str, float]:
        return {n: j.slowdown for p in self.groups for n, j in p.result.jobs.items()}

    def over(self, bound: float) -> int:
        """Jobs predicted to slow past ``bound``."""
        return sum(1 for v in self.slowdown().values() if v > bound)

    def same_as(self, other: Plan) -> bool:
        return sorted(p.jobs for p in self.groups) == sorted(p.jobs for p in other.groups)

    def to_dict(self) -> dict:
        return {"duty": round(self.duty, 4), "gpus": self.gpus, "groups": [p.to_dict() for p in self.groups]}


@dataclass
class Advice:
    proposal: Plan
    today: Plan
    overhead_s: float
    skipped: list[str] = field(default_factory=list)     # jobs without enough phases to plan with
    estimated: list[str] = field(default_factory=list)   # jobs never swapped: their swap time is estimated
    rate: str = ""                                       # how: "observed" (other jobs' swaps) or "assumed"
    kept: str = ""                                       # why today's grouping is the proposal ("": it is not)

    def to_dict(self) -> dict:
        return {"proposal": self.proposal.to_dict(), "today": self.today.to_dict(),
                "overhead_s": round(self.overhead_s, 5), "skipped": self.skipped,
                "swap_estimated": {"jobs": self.estimated, "rate": self.rate},
                "gain": round(self.proposal.duty - self.today.duty, 4), "kept": self.kept}


def observed_rates(profiles: list[JobProfile]) -> tuple[float | None, float | None]:
    """(snapshot, restore) bytes per second over every swap the profiles recorded (None: no swap seen)."""
    totals = [[0.0, 0.0], [0.0, 0.0]]                 # [bytes, ms] for snapshot, restore
    for p in profiles:
        moved = p.per_gpu_bytes * p.gpu_count
        for k, xs in enumerate((p.snapshot_ms, p.restore_ms)):
            if xs and moved:
                totals[k][0] += moved * len(xs)
                totals[k][1] += sum(xs)
    snap, rest = (b / ms * 1000 if ms > 0 else None for b, ms in totals)
    return snap, rest


def sim_job(p: JobProfile, gbps: float = DEFAULT_GBPS, rates: tuple[float | None, float | None] = (None, None)
            ) -> SimJob:
    """A profile as the simulator's job: its samples in seconds, its swaps as measured; a job never
    swapped is estimated at the rate the cluster's other swaps ran at (else ``gbps``)."""
    moved = p.per_gpu_bytes * p.gpu_count
    snap_guess, rest_guess = (moved / (r or gbps * 1e9) for r in rates)
    return SimJob(p.job, tuple(h / 1000 for h in p.hold_ms), tuple(g / 1000 for g in p.gap_ms),
                  mean(p.snapshot_ms) / 1000 if p.snapshot_ms else snap_guess,
                  mean(p.restore_ms) / 1000 if p.restore_ms else rest_guess,
                  int(p.per_gpu_bytes * (1 + LOCKD_MARGIN_FRACTION)), p.busy_share, alone_step_s(p))


def alone_step_s(p: JobProfile) -> float:
    """The job's step with no lock at all, from its profile: its own measure of its holds (``busy_ms``)
    plus its gap less the lock's legs of it. lockd's hold of a job runs from the grant to the yield's
    arrival, so it exceeds the job's own measure by the grant's delivery and the yield's way in; the
    gap (the yield to the next request's arrival) carries the same two legs the other way (the yield's
    answer, the request's way in), taken here as equal to the hold's. 0 where the job did not say."""
    if not p.busy_ms:
        return 0.0
    legs = max(0.0, mean(p.hold_ms) - mean(p.busy_ms))
    return max(0.0, (mean(p.busy_ms) + mean(p.gap_ms) - legs) / 1000)


class Advisor:
    def __init__(self, ps: ProfileSet, opts: Options = Options()):
        self.ps, self.opts = ps, opts
        best: dict[str, JobProfile] = {}
        self.skipped: list[str] = []
        for p in ps.profiles:
            if not p.usable():
                continue
            if p.job not in best or len(p.hold_ms) > len(best[p.job].hold_ms):
                best[p.job] = p          # a job in several groups: the one it ran most in
        self.skipped = sorted({p.job for p in ps.profiles} - set(best))
        self.profiles = dict(sorted(best.items()))
        self.sets = {g.group: g for g in ps.groups}
        rates = observed_rates(list(self.profiles.values()))
        self.jobs = {n: sim_job(p, opts.gbps, rates) for n, p in self.profiles.items()}
        self.estimated = sorted(n for n, p in self.profiles.items() if not (p.snapshot_ms and p.restore_ms))
        self.rate = "observed" if all(rates) else f"assumed {opts.gbps:g} GB/s"
        self.overhead_s = opts.overhead_s if opts.overhead_s is not None else DEFAULT_HANDOFF_S
        self._cache: dict[tuple[str, ...], Candidate] = {}

    # -- the GPUs ------------------------------------------------------------------------
    def set_gpus(self, group: str) -> int:
        g = self.sets.get(group)
        if g is None:
            return 0
        n = 0
        for node, gpus in g.nodes:
            info = self.ps.node(node)
            n += len(gpus) if gpus else (len(info.gpus) if info and info.gpus else 1)
        return n

    def set_capacity(self, group: str) -> int:
        g = self.sets.get(group)
        sizes = []
        for node, gpus in (g.nodes if g else []):
            info = self.ps.node(node)
            if info is None:
                continue
            sizes += [info.gpu_total(i) for i in gpus] if gpus else [info.gpu_total()]
        return min((s for s in sizes if s > 0), default=0)

    def gpus_of(self, job: str) -> int:
        return self.set_gpus(self.profiles[job].group) or self.profiles[job].gpu_count

    def _capacity_for(self, members: tuple[str, ...]) -> int:
        caps = [self.set_capacity(self.profiles[j].group) for j in members]
        known = [c for c in caps if c > 0]
        if known:
            return min(known)
        same = [self.set_capacity(s) for s in self.sets if self.set_gpus(s) == self.gpus_of(members[0])]
        return min((c for c in same if c > 0), default=0)

    def _host_room(self, members: tuple[str, ...]) -> tuple[bool, str]:
        """Snapshots of all members but the smallest must fit the free host memory of its node."""
        nodes = {n for j in members for n, _ in (self.sets[self.profiles[j].group].nodes
                                                 if self.profiles[j].group in self.sets else [])}
        free = [info.host_free_bytes for n in nodes if (info := self.ps.node(n)) and info.host_free_bytes > 0]
        if not free or len(members) < 2:
            return True, ""
        sizes = sorted(self.profiles[j].per_gpu_bytes * self.gpus_of(j) for j in members)
        need = sum(sizes[1:])
        return (need <= min(free), "" if need <= min(free) else
                f"parked snapshots need {need} B of host memory, {min(free)} B free")

    # -- judging a group -------------------------------------------------------------------
    def evaluate(self, members: tuple[str, ...], overhead_s: float | None = None) -> Candidate:
        members = tuple(sorted(members))
        oh = self.overhead_s if overhead_s is None else overhead_s
        key = members if overhead_s is None else (*members, f"@{oh}")
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        res = simulate([self.jobs[j] for j in members], SimGroup(self._capacity_for(members), oh, oh),
                       cycles=self.opts.cycles, seed=self.opts.seed)
        why = ""
        if len({self.gpus_of(j) for j in members}) > 1:
            why = "jobs on different numbers of GPUs"
        elif res.max_slowdown > self.opts.max_slowdown:
            worst = max(res.jobs.values(), key=lambda r: r.slowdown)
            why = f"{worst.name} slowed {worst.slowdown:+.0%} (bound {self.opts.max_slowdown:.0%})"
        else:
            why = self._host_room(members)[1]
        cap = self._capacity_for(members)
        big = [j for j in members if cap and self.profiles[j].per_gpu_bytes > cap]
        if big:
            why = f"{big[0]} does not fit a GPU of {cap} B"
        pl = Candidate(members, self.gpus_of(members[0]), res, feasible=not why or len(members) == 1, why=why)
        self._cache[key] = pl
        return pl

    def calibrate(self, today: list[tuple[str, ...]]) -> float:
        """The grant/swap-step overhead that makes today's simulated waits match the measured ones."""
        measured = {j: mean(self.profiles[j].wait_ms) / 1000 for g in today for j in g}

        def err(oh: float) -> float:
            e = 0.0
            for g in today:
                res = self.evaluate(g, oh).result
                e += sum((res.jobs[j].mean_wait_s - measured[j]) ** 2 for j in g)
            return e

        lo, hi = 0.0, 0.2
        for _ in range(24):                      # golden-section search on [0, 0.2] s
            a, b = hi - (hi - lo) * 0.618, lo + (hi - lo) * 0.618
            if err(a) <= err(b):
                hi = b
            else:
                lo = a
        return (lo + hi) / 2

    # -- today and the proposal ---------------------------------------------------------------
    def today_groups(self) -> list[tuple[str, ...]]:
        by: dict[str, list[str]] = {}
        for j, p in self.profiles.items():
            by.setdefault(p.group, []).append(j)
        return [tuple(sorted(v)) for _, v in sorted(by.items())]

    def advise(self) -> Advice:
        today = self.today_groups()
        if self.opts.overhead_s is None and today:
            self.overhead_s = self.calibrate(today)
        today_plan = Plan([replace(self.evaluate(g), gpu_set=self.profiles[g[0]].group) for g in today])
        names = list(self.profiles)
        feasible: dict[tuple[str, ...], Candidate] = {(j,): self.evaluate((j,)) for j in names}
        pairs = [c for c in itertools.combinations(names, 2) if self.evaluate(c).feasible]
        feasible.update({c: self.evaluate(c) for c in pairs})
        ok_pairs = set(pairs)
        for size in range(3, self.opts.max_group_size + 1):
            for c in itertools.combinations(names, size):
                if all(s in ok_pairs for s in itertools.combinations(c, 2)):
                    pl = self.evaluate(c)
                    if pl.feasible:
                        feasible[c] = pl
        groups = self._fit_sets(self._improve(self._greedy(names, feasible), feasible), feasible)
        plan = Plan(sorted((replace(feasible[g]) for g in groups), key=lambda p: p.jobs))
        self._assign(plan)
        kept = self.no_better(plan, today_plan)
        if kept:
            plan = Plan([replace(p) for p in today_plan.groups])
        return Advice(plan, today_plan, self.overhead_s, self.skipped, self.estimated, self.rate, kept)

    def no_better(self, plan: Plan, today: Plan) -> str:
        """Why ``plan`` is not worth proposing over ``today`` ("" : it is): it is today's grouping, or it
        slows more jobs past the bound, or as many and gains less than ``min_gain`` of duty. The search
        (greedy packing, local search, then merging down to the GPU sets there are) can end on a
        grouping it predicts worse than today's; a proposal must be better by its own prediction."""
        if not today.groups or plan.same_as(today):
            return "the search found today's grouping" if today.groups else ""
        bound = self.opts.max_slowdown
        po, to = plan.over(bound), today.over(bound)
        if po > to:
            return f"the best grouping found slows {po} job(s) past {bound:.0%}, today's {to}"
        if po == to and plan.duty < today.duty + self.opts.min_gain:
            return (f"the best grouping found predicts {plan.duty:.1%} against today's {today.duty:.1%} "
                    f"(less than {self.opts.min_gain:.1%} better)")
        return ""

    @staticmethod
    def _greedy(names: list[str], feasible: dict[tuple[str, ...], Candidate]) -> list[tuple[str, ...]]:
        taken: set[str] = set()
        out = []
        for c, _ in sorted(feasible.items(), key=lambda kv: (-len(kv[0]), -kv[1].duty, kv[0])):
            if not taken & set(c):
                out.append(c)
                taken.update(c)
        return out + [(n,) for n in names if n not in taken]

    def _improve(self, groups: list[tuple[str, ...]], feasible: dict[tuple[str, ...], Candidate]
                 ) -> list[tuple[str, ...]]:
        def score(gs: list[tuple[str, ...]]) -> tuple[float, float]:
            return sum(feasible[g].gpus * feasible[g].duty for g in gs), sum(feasible[g].gpus for g in gs)

        w, n = score(groups)
        for _ in range(MAX_IMPROVE_ROUNDS):
            best: tuple[float, list[tuple[str, ...]]] | None = None
            for a, b in itertools.combinations(range(len(groups)), 2):
                rest = [g for k, g in enumerate(groups) if k not in (a, b)]
                rw, rn = score(rest)
                for part in _partitions(sorted(groups[a] + groups[b]), feasible):
                    pw, pn = score(part)
                    d = (rw + pw) / (rn + pn) - w / n
                    if d > 1e-9 and (best is None or d > best[0]):
                        best = (d, rest + part)
            if best is None:
                break
            groups = best[1]
            w, n = score(groups)
        return groups

    def _fit_sets(self, groups: list[tuple[str, ...]], feasible: dict[tuple[str, ...], Candidate]
                  ) -> list[tuple[str, ...]]:
        """No more groups of N GPUs than there are GPU sets of N GPUs: merge the pair of groups whose
        union slows its worst job least (it may break the bound: then the proposal says so)."""
        limits: dict[int, int] = {}
        for s in self.sets:
            limits[self.set_gpus(s)] = limits.get(self.set_gpus(s), 0) + 1
        if not limits:
            return groups                         # no GPU sets known (a file without groups): no limit
        for gpus, limit in sorted(limits.items()):
            while True:
                mine = [g for g in groups if feasible[g].gpus == gpus]
                if len(mine) <= max(1, limit):
                    break
                best = min((tuple(sorted(a + b)) for a, b in itertools.combinations(mine, 2)),
                           key=lambda u: (self.evaluate(u).result.max_slowdown, -self.evaluate(u).duty, u))
                feasible[best] = self.evaluate(best)
                groups = [g for g in groups if not set(g) & set(best)] + [best]
        return groups

    def _assign(self, plan: Plan) -> None:
        """Give each proposed group the GPUs of an existing group: one of its members' if free."""
        free = {s for s in self.sets}
        for pl in sorted(plan.groups, key=lambda p: -len(p.jobs)):
            mine = [self.profiles[j].group for j in pl.jobs if self.profiles[j].group in free]
            same = [s for s in sorted(free) if self.set_gpus(s) == pl.gpus]
            pick = max(mine, key=mine.count) if mine else (same[0] if same else "")
            if pick:
                free.discard(pick)
            pl.gpu_set = pick


def _partitions(items: list[str], feasible: dict[tuple[str, ...], Candidate]):
    """Every partition of ``items`` into feasible groups (tuples sorted as in ``feasible``)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for k in range(len(rest) + 1):
        for others in itertools.combinations(rest, k):
            g = tuple(sorted((first, *others)))
            if g in feasible:
                left = [x for x in rest if x not in others]
                for tail in _partitions(left, feasible):
                    yield [g, *tail]


def advise(ps: ProfileSet, opts: Options = Options()) -> Advice:
    return Advisor(ps, opts).advise()
