"""Spindle's own planner: the candidate plans `make_plan_with_cost` builds from the wave
schedules (device bounds, fused levels, lighter rebuilds, task-stable schedules, task lanes,
the baselines' schedules, placements again) and the one it keeps, by simulated iteration.

What does not live here: the schedules themselves (`schedules.py`), assembling a candidate
into a Plan (`assemble.py`), the search over memory settings (`api.fitting_plan_with_cost`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, NamedTuple

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.plan import Plan
from spindle_cli.artifacts.profile import Profile
from spindle_cli.errors import OutOfMemory, PlanInfeasible
from spindle_cli.planner import baselines
from spindle_cli.planner.alignment import MaxOps, PlannedWave, compute_ms
from spindle_cli.planner.allocation import single_count
from spindle_cli.planner.assemble import assemble
from spindle_cli.planner.buckets import backend_sync, max_chunks, sync_buckets
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.placement import PlacedWaves, Ranks
from spindle_cli.planner.schedules import (
    Schedules,
    fused_waves,
    slice_limits,
    split_first_long_wave,
)
from spindle_cli.planner.simulate import simulated_cost
from spindle_cli.planner.tasks import lane_waves, task_lanes, task_sizes, task_stable

NEAR_BEST = 0.02
"""A task-stable schedule of the balanced group sizes within this share of the best plan's
simulated iteration has its neighbours tried (`_Search.consider_task_stable`), and a
device bound's plan within it is planned again from the spread allocation."""

SIMULATED_CHOICE_MAX_DEVICES = 1024
"""Largest cluster on which Spindle chooses among all its candidates by simulation. On 4096
devices the synthetic 100-task model of benchmarks/bench_planner.py simulates in ~1 s per
candidate: choosing among its 11 took 19.8 s (11.5 s of simulation), against the 10 s planning
target, and gave a plan 16% faster (170.1 against 203.3 ms simulated). Above it Spindle
simulates its first candidate (the whole cluster's bound) and the three baselines' schedules
only, and keeps the fastest: so that it is still never slower than a baseline (multitask-clip
4 tasks on 1280 devices: its first candidate 68.13 ms, Optimus 66.84)."""


def device_caps(cluster: ClusterSpec) -> tuple[int, ...]:
    """The per-MetaOp device bounds Spindle plans under: the whole cluster, then halving while
    at least an island is left, and one island (24 devices in islands of 8: 24, 12, 8). A
    bound at island size keeps every slice inside one node, so its activations and parameter
    groups never cross the one NIC per node; a larger slice computes faster but pays for both,
    and under memory pressure a smaller bound spreads a large model's layers over more ranks
    (qwen-val-70b on 256 devices fits with ZeRO-2 only under 32). Which bound wins depends on
    the model, so each is planned and the simulator decides (`make_plan_with_cost`). Above
    SIMULATED_CHOICE_MAX_DEVICES only the whole cluster is used: one simulation there takes
    about as long as the planning target allows a candidate."""
    caps = [cluster.num_devices]
    if cluster.num_devices > SIMULATED_CHOICE_MAX_DEVICES:
        return tuple(caps)
    while caps[-1] // 2 >= cluster.island_size and caps[-1] % 2 == 0:
        caps.append(caps[-1] // 2)
    if caps[-1] > cluster.island_size:
        caps.append(cluster.island_size)
    return tuple(caps)


class _Kept(NamedTuple):
    """The best candidate so far in `make_plan_with_cost`."""

    iteration_ms: float
    plan: Plan
    caps: tuple[int, ...]
    """The device bound of each level."""
    fused: bool
    """Whether its levels were scheduled at once (`fused_waves`)."""
    planned: list[PlannedWave]
    """Its waves before placement."""
    home: dict[str, Ranks] | None
    """The ranks its MetaOps preferred in placement (`consider`'s `home`)."""
    label: str
    """What it is, after its device bounds (`consider`'s `label`)."""
    spread: bool
    """Whether its levels' allocations spread spare devices (`allocation.allocate_level`)."""
    transfer_ms: float
    """Its simulated wait for transfers (`simulated_cost`)."""

    @property
    def compute_and_wait_ms(self) -> float:
        """Its compute plus its wait for transfers: what a schedule that moves no rows between
        ranks must compute below to be worth simulating."""
        return self.plan.estimated_iteration_ms + self.transfer_ms


def make_plan_with_cost(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                        options: PlanOptions = PlanOptions(),
                        inputs: tuple[InputRef, ...] = (),
                        schedules: Schedules | None = None,
                        give_up_ms: float = math.inf,
                        finished: list[tuple[float, Plan]] | None = None,
                        baseline_plans: list[Plan] | None = None, own: bool = True,
                        limited: set[str] | None = None) -> tuple[Plan, float | None]:
    """Plan one training iteration of `graph` on `cluster`; with the plan, its simulated
    iteration (ms) where the planner chose it among all its candidates by simulation (None for
    the baselines, and above SIMULATED_CHOICE_MAX_DEVICES, where the memory search keeps the
    first setting that fits). `schedules`: those of earlier calls with the same graph,
    profile, cluster and curve options (`Schedules`), to reuse. `give_up_ms`: an iteration
    the caller already has, so no candidate is simulated beyond it; where none beats it the
    iteration returned is only a lower bound, at least `give_up_ms`. `finished`, where
    given, gets every candidate simulated to the end, with its iteration; `baseline_plans`
    the baselines' schedules as Spindle assembled them (`_Search.consider_baselines`). Without
    `own`, Spindle tries the baselines' schedules only (`api.fitting_plan_with_cost`, under
    recomputation where memory limited nothing without it), so that it still never simulates
    slower than a baseline. `limited`, where given, gets what device memory limited in Spindle's
    search: 'slices' (a candidate's slice runs as many operators as memory allows on its
    devices, `slice_limits`, fewer than its MetaOp has), 'candidates' (one did not fit),
    'placement' (memory kept a slice off a free rank, `PlacedWaves.short_of_memory`).

    Spindle schedules every level once per device bound of `device_caps` and keeps the plan
    whose simulated iteration (compute, inter-wave transfers, gradient sync:
    planner/simulate.py) is shortest, the first on ties. Its candidates, in the order
    `_Search.run` tries them (each method says why, with the figures measured): one bound for
    all levels, each also from the allocation that spreads a level's spare devices
    (`consider_bounds`), then the longest level alone under each other bound
    (`consider_longest_level`), then all levels fused into one schedule under the smallest
    bound (`consider_fused`), then the kept plan rebuilt to move fewer rows between ranks
    (`consider_rebuilt`), under ZeRO-1/2 the kept plan with its first long wave split in two
    (`consider_first_wave_split`), then each task on one device group through all its levels
    (`consider_task_stable`), then, where tasks outnumber the groups, tasks one after another
    on lanes of equal groups (`consider_lanes`), then the three baselines' schedules, so that
    Spindle never simulates slower than a baseline (`consider_baselines`; `api` tries each
    with finer gradient chunks). Finally the kept plan's waves are placed again, with ranks
    reserved for the slices that would keep their rows there and on consecutive ranks, and so
    is Spindle's own best when a baseline's schedule is kept (`consider_placed_again`); where
    the baseline's still wins, both are tried with finer gradient chunks
    (`finer_chunks_of_both`). Candidates with the same waves are simulated once; a one-island
    cluster has a single device bound and the other candidates. The allocator and the wave
    scheduler see compute only; the simulator is the planner's cost model for what they cannot
    see. The levels' lower bounds stay the uncapped C*, so `lower_bound_ms` is the relaxed
    optimum whichever plan is kept. Baselines are planned once, as their rules say."""
    n_dev = cluster.num_devices
    if schedules is None:
        schedules = Schedules(graph, profile, cluster, options, inputs=inputs)
    elif not schedules.serves(graph, profile, cluster, options):
        raise ValueError("schedules of another graph, profile, cluster or curve options")
    curves, allocs = schedules.curves, schedules.allocs
    max_ops = slice_limits(graph, curves, cluster, options.memory)
    if options.planner != "spindle":
        if options.planner == "sequential":
            planned = baselines.sequential(graph, curves, max_ops)
        elif options.planner == "optimus":
            planned = baselines.optimus(graph, curves, n_dev, max_ops)
        else:
            planned = baselines.distmm(graph, curves, n_dev, max_ops)
        return assemble(graph, curves, cluster, options, inputs, allocs, planned), None
    search = _Search(graph, profile, cluster, options, inputs, schedules, max_ops,
                     give_up_ms=give_up_ms, finished=finished, baseline_plans=baseline_plans)
    try:
        return search.run() if own else search.run_baselines()
    finally:
        if limited is not None:
            limited.update(search.limited())


_Key = tuple[tuple[PlannedWave, ...], bool, bool, bool]
"""A candidate as `_Search.consider` tells candidates apart (`_key`)."""


def _key(planned: list[PlannedWave], *, home: bool = False, reserve: bool = False,
         consecutive: bool = False) -> _Key:
    """A candidate's waves and whether it was placed with home ranks, with ranks reserved, or
    on consecutive ranks: bounds that change nothing give the same waves, hence (placed alike)
    the same plan and iteration."""
    return tuple(planned), home, reserve, consecutive


class _Search:
    """One `make_plan_with_cost` of the spindle planner: the candidates it assembles and
    simulates (`consider`), and the best of them so far."""

    def __init__(self, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                 options: PlanOptions, inputs: tuple[InputRef, ...], schedules: Schedules,
                 max_ops: MaxOps, *, give_up_ms: float,
                 finished: list[tuple[float, Plan]] | None,
                 baseline_plans: list[Plan] | None = None) -> None:
        self.graph, self.profile, self.cluster = graph, profile, cluster
        self.options, self.inputs, self.schedules = options, inputs, schedules
        self.curves, self.allocs = schedules.curves, schedules.allocs
        self.max_ops, self.give_up_ms, self.finished = max_ops, give_up_ms, finished
        self.baseline_plans = baseline_plans
        self.n_dev = cluster.num_devices
        self.whole_cluster = (self.n_dev,) * len(self.allocs)
        """Every level's device bound at the whole cluster (the task-stable, task-lane and
        baselines' schedules')."""
        self.by_cap: dict[tuple[int, bool], list[list[PlannedWave]]] = {}
        """Each level's schedule under a device bound, by (bound, spread)."""
        self.best: _Kept | None = None
        self.error: PlanInfeasible | None = None
        self.bounds = device_caps(cluster)
        self.every_candidate = self.n_dev <= SIMULATED_CHOICE_MAX_DEVICES
        """Whether every candidate is tried (above SIMULATED_CHOICE_MAX_DEVICES the first and
        the baselines' schedules only)."""
        self.tried: dict[_Key, Plan | None] = {}
        """The candidates `consider` assembled: each plan, None where it did not fit."""
        # candidates that begin with the same waves place them alike (`placement.PlacedWaves`)
        self.placements = PlacedWaves(graph, cluster)
        self.last_ms = math.inf
        """The simulated iteration of the last candidate `consider` simulated (inf when it was
        not), up to the point where the simulation gave up."""
        self.last_failed = False
        """Whether the last candidate `consider` assembled did not fit (PlanInfeasible)."""
        self.last_plan: Plan | None = None
        """The last candidate `consider` simulated to the end (None when it was not; `last_ms`
        is then its iteration)."""
        self.layers = {m.id: m.num_layers for m in graph.metaops}
        self.out_of_memory = False
        """Whether a candidate `consider` assembled ran out of memory."""
        self.at_slice_limit = False
        """Whether a slice of a candidate `consider` assembled runs as many operators as
        memory allows on its devices, fewer than its MetaOp has."""

    def limited(self) -> set[str]:
        """What device memory limited in the candidates so far (`make_plan_with_cost`'s
        `limited`)."""
        return {what for what, found in (("slices", self.at_slice_limit),
                                         ("candidates", self.out_of_memory),
                                         ("placement", self.placements.short_of_memory))
                if found}

    def run(self) -> tuple[Plan, float | None]:
        """`make_plan_with_cost`'s candidates in its order; the kept plan and its simulated
        iteration (None above SIMULATED_CHOICE_MAX_DEVICES, where only the first candidate
        and the baselines' schedules are simulated, to choose among them)."""
        made_caps = self.consider_bounds()
        if self.best is not None and len(made_caps) > 1:
            self.consider_longest_level(made_caps)
        runner_up = (self.consider_fused(self.bounds[-1])
                     if len(self.allocs) > 1 and self.every_candidate else None)
        if self.best is not None and self.every_candidate:
            self.consider_rebuilt(runner_up)
        if self.best is not None and self.every_candidate and 1 <= self.options.zero <= 2:
            self.consider_first_wave_split()
        if self.best is not None and self.every_candidate and len(self.graph.tasks) > 1:
            self.consider_task_stable()
            self.consider_lanes()
        return self.run_baselines(self.best)

    def run_baselines(self, own: _Kept | None = None) -> tuple[Plan, float | None]:
        """The baselines' schedules, then the kept plan placed again (`consider_placed_again`,
        with Spindle's own best `own`) and, where a baseline's schedule is kept, given finer
        chunks (`finer_chunks_of_both`): the end of `run`, and the whole search without
        `make_plan_with_cost`'s `own`. The kept plan and its simulated iteration."""
        self.consider_baselines()
        if self.best is not None and self.every_candidate:
            mine = self.consider_placed_again(own)
            if "'s schedule" in self.best.label and backend_sync(self.cluster.backend) == "chunked":
                return self.finer_chunks_of_both(mine)
        if self.best is None:
            assert self.error is not None
            raise self.error
        return self.best.plan, self.best.iteration_ms if self.every_candidate else None

    def levels(self, cap: int, spread: bool) -> list[list[PlannedWave]]:
        """Each level's schedule under a device bound, from `spread` allocations or not (made
        once; PlanInfeasible when some MetaOp has no valid count under the bound)."""
        if (cap, spread) not in self.by_cap:
            self.by_cap[(cap, spread)] = self.schedules.levels(
                cap, self.schedules.capped(cap, spread)[1], self.max_ops)
        return self.by_cap[(cap, spread)]

    def consider(self, caps: tuple[int, ...], planned: list[PlannedWave] | None = None, *,
                 spread: bool = False, fused: bool = False,
                 home: dict[str, Ranks] | None = None, label: str = "", slack: float = 0.0,
                 reserve: Plan | None = None, consecutive: bool = False) -> bool:
        """Assemble and simulate a candidate (its levels' schedules under `caps` with
        `spread` allocations unless `planned`; placed with `home`, and with `reserve`: the
        plan these waves were placed as, placed again with ranks reserved for their rows,
        `placement.place`, skipped where that changes nothing, or with `consecutive`: on
        consecutive ranks; `label`: what it is, after its device bounds, in Plan.candidate;
        simulated until it is `slack` above the best, so `last_ms` tells how close it came);
        whether it is now the best."""
        self.last_ms, self.last_failed, self.last_plan = math.inf, False, None
        if planned is None:
            planned = [w for level, cap in enumerate(caps)
                       for w in self.levels(cap, spread)[level]]
        best = self.best
        # bounds that change nothing give the same waves, hence (placed alike) the same plan
        # and iteration; and a plan whose waves alone outlast the best iteration cannot beat it
        key = _key(planned, home=home is not None, reserve=reserve is not None,
                   consecutive=consecutive)
        if key in self.tried:
            # as it did before: other bounds, the same waves
            self.last_failed = self.tried[key] is None
            return False
        if best is not None and compute_ms(planned) >= best.iteration_ms:
            return False
        bounds_text = "/".join(map(str, caps)) if len(set(caps)) > 1 else str(caps[0])
        candidate = ", ".join(x for x in ("fused" if fused else "level by level",
                                          f"device bound {bounds_text}",
                                          "spare devices spread" if spread else "", label) if x)
        try:
            plan = assemble(self.graph, self.curves, self.cluster, self.options, self.inputs,
                            self.allocs, planned, home, reserve=reserve is not None,
                            consecutive=consecutive, candidate=candidate,
                            placements=self.placements)
        except PlanInfeasible as e:
            self.error, self.last_failed, self.tried[key] = self.error or e, True, None
            self.out_of_memory = self.out_of_memory or isinstance(e, OutOfMemory)
            return False
        self.tried[key] = plan
        self.at_slice_limit = self.at_slice_limit or any(
            s.num_layers == self.max_ops(s.metaop, len(s.ranks)) < self.layers[s.metaop]
            for _, s in plan.slices())
        if reserve is not None and plan.waves == reserve.waves:
            return False  # nothing was reserved: that plan again
        cost = simulated_cost(plan, self.graph, self.profile, self.cluster, give_up_ms=min(
            self.give_up_ms, best.iteration_ms * (1 + slack) if best else math.inf))
        self.last_ms = cost.iteration_ms
        self.last_plan = plan if math.isfinite(cost.transfer_ms) else None
        if self.finished is not None and self.last_plan is not None:
            self.finished.append((self.last_ms, self.last_plan))
        if best is None or cost.iteration_ms < best.iteration_ms - 1e-9:
            self.best = _Kept(iteration_ms=cost.iteration_ms, plan=plan, caps=caps, fused=fused,
                              transfer_ms=cost.transfer_ms, planned=planned, home=home,
                              label=label, spread=spread)
            return True
        return False

    def consider_bounds(self) -> list[int]:
        """Each bound of `device_caps` for all levels, each also from the allocation that
        spreads a level's spare devices over its flat MetaOps (`allocation.allocate_level`'s
        `spread`) when the plan without simulated within NEAR_BEST of the best (or when no plan
        fits: spread, a flat module's state is sharded by ZeRO). Returns the bounds under which
        levels were scheduled, in order."""
        for cap in self.bounds:
            try:
                _, capped_allocs = self.schedules.capped(cap)
            except PlanInfeasible as e:
                self.error = self.error or e
                continue
            if self.best is not None and (math.fsum(a.lower_bound_ms for a in capped_allocs)
                                          >= self.best.iteration_ms):
                # its compute alone (>= its C*) would outlast the best plan's whole iteration
                continue
            self.consider((cap,) * len(self.allocs), slack=NEAR_BEST)
            if self.best is not None and self.every_candidate and (
                    self.last_failed or self.last_ms <= self.best.iteration_ms * (1 + NEAR_BEST)):
                self.consider((cap,) * len(self.allocs), spread=True)
        made_caps = list(dict.fromkeys(cap for cap, _ in self.by_cap))
        if self.best is None:
            # nothing fits: spare devices spread a flat MetaOp's memory (and ZeRO shards it)
            for cap in made_caps:
                self.consider((cap,) * len(self.allocs), spread=True)
        return made_caps

    def consider_longest_level(self, made_caps: list[int]) -> None:
        """The longest level alone under each other bound of `made_caps`, the other levels
        keeping the kept plan's: it may do better under another bound than under the kept
        one (long encoders computing on more than an island, the rest inside; multitask-clip
        4 tasks on 32 devices: the encoders on the whole cluster, the short levels inside
        islands); spread or not as the kept plan, the other way too where that does not fit."""
        assert self.best is not None
        caps, spread = self.best.caps, self.best.spread
        longest = max(range(len(self.allocs)),
                      key=lambda i: compute_ms(self.levels(caps[i], spread)[i]))
        for cap in made_caps:
            if cap != caps[longest]:
                mixed = caps[:longest] + (cap,) + caps[longest + 1:]
                self.consider(mixed, spread=spread)
                if self.last_failed:
                    self.consider(mixed, spread=not spread)

    def consider_fused(self, cap: int) -> tuple[tuple[int, ...], bool, bool] | None:
        """All levels at once under the smallest bound (one island on clusters that halve down
        to it; OFASys 4 tasks on 32 devices: each task's chain inside one node, no level
        barriers): there a level cannot be balanced by giving its long MetaOps more devices,
        so its barrier idles the others' devices (`fused_waves`). Simulated only when it
        computes faster than level by level under the same bound (or, when that schedule
        was pruned, than the best plan's whole iteration). Returns the runner-up, fused or
        not, where it simulated within NEAR_BEST of the best (as `consider_lighter`'s
        arguments): rebuilt to move fewer rows, either may win."""
        before = self.best
        bar_ms = (compute_ms(w for level in self.by_cap[(cap, False)] for w in level)
                  if (cap, False) in self.by_cap
                  else before.iteration_ms if before is not None else math.inf)
        try:
            capped, capped_allocs = self.schedules.capped(cap)
        except PlanInfeasible:
            return None
        fused = self.schedules.made(("fused", cap, True, False, False), self.max_ops,
                                    fused_waves, self.graph, capped, capped_allocs, self.n_dev)
        if compute_ms(fused) >= bar_ms - 1e-9:
            return None
        fused_caps = (cap,) * len(self.allocs)
        if self.consider(fused_caps, fused, fused=True, slack=NEAR_BEST):
            assert self.best is not None
            if (before is not None
                    and before.iteration_ms <= self.best.iteration_ms * (1 + NEAR_BEST)):
                return before.caps, before.fused, before.spread
        elif self.best is not None and self.last_ms <= self.best.iteration_ms * (1 + NEAR_BEST):
            return fused_caps, True, False
        return None

    def consider_rebuilt(self, runner_up: tuple[tuple[int, ...], bool, bool] | None) -> None:
        """The kept plan rebuilt to move fewer rows between ranks (`consider_lighter`: no
        extension, or one device count per MetaOp; in the bench before the ZeRO all-gather was
        simulated, multitask-clip 4 tasks on 32 devices: 49.5 ms instead of 53.1, qwen-val on
        64: 813.0 instead of 862.5), and so is `consider_fused`'s runner-up; where the kept
        plan spreads spare devices, the allocations before the spread on one count per MetaOp
        too: spread allocations give flat MetaOps more devices, so their groups sync over more
        ranks, and so does their rebuild on one count per MetaOp; that of the allocations as
        they were may sync far less (a sweep case, four multitask-clip tasks on 2x6 GPUs:
        79.9 ms against the spread rebuild's 97.0 and the kept plan's 95.1)."""
        kept = self.best
        assert kept is not None
        self.consider_lighter(kept.caps, kept.fused, kept.spread)
        if runner_up is not None:
            self.consider_lighter(*runner_up)
        if kept.spread and not kept.fused:
            self.consider_lighter(kept.caps, False, False, one_count_only=True)

    def consider_lighter(self, caps: tuple[int, ...], fused: bool, spread: bool,
                         one_count_only: bool = False) -> None:
        """The kept plan's schedule rebuilt, from allocations as `spread` as its own, to move
        fewer rows between ranks: with idle devices left idle (an extension gives a MetaOp
        more devices for one wave, re-splitting its rows into and out of it), and with each
        MetaOp on one device count per level (`allocation.single_count`: the bi-point split
        re-splits them once; that one alone with `one_count_only`). Each computes slower and
        may simulate faster."""
        ways = ((True, True),) if one_count_only else ((False, False), (True, True))
        for extend, one_count in ways:
            label = "one count per MetaOp" if one_count else "no extension"
            rebuilt: dict[int, list[list[PlannedWave]]] = {}
            for cap in sorted(set(caps)):
                capped, capped_allocs = self.schedules.capped(cap, spread)
                if one_count:
                    capped_allocs = [single_count(a) for a in capped_allocs]
                if fused:
                    self.consider(caps, self.schedules.made(
                        ("fused", cap, extend, one_count, spread), self.max_ops, fused_waves,
                        self.graph, capped, capped_allocs, self.n_dev, extend=extend),
                        spread=spread, fused=True, label=label)
                else:
                    rebuilt[cap] = self.schedules.levels(cap, capped_allocs, self.max_ops,
                                                         extend=extend)
            if not fused:
                self.consider(caps, [w for level, cap in enumerate(caps)
                                     for w in rebuilt[cap][level]], spread=spread, label=label)

    def consider_first_wave_split(self) -> None:
        """Under ZeRO-1/2, the kept plan with its first long wave split in two
        (`split_first_long_wave`): a slice starts once the previous step's all-gather of its
        first layer's bucket has arrived, and buckets are cut per wave into at most
        `buckets.MAX_CHUNKS` chunks, so a short first wave's layers arrive sooner (in the
        132-case quality sweep 22 cases 0.1-3.9% slower without it)."""
        kept = self.best
        assert kept is not None
        split = split_first_long_wave(kept.planned)
        if split is not None:
            self.consider(kept.caps, split, spread=kept.spread, fused=kept.fused, home=kept.home,
                          label=_labelled(kept.label, "first wave split"))

    def consider_task_stable(self) -> None:
        """Each task on one device group through all its levels (`tasks.task_stable`), the
        levels fused, with and without extension: no rows re-split inside a task, where the
        level-by-level balance re-splits them at every level. The group sizes are
        `tasks.balanced_counts` and its nearest neighbours (`tasks.task_sizes`; OFASys 7
        tasks on 32 devices, before the ZeRO all-gather was simulated: 73.3 ms, against 80.35
        for the balanced counts alone and 85.4 level by level). A schedule placed as usual
        that becomes the best plan is placed again with every task preferring its own ranks
        (`tasks.home_groups`), and the faster kept: neither wins everywhere (with the
        balanced counts alone, OFASys 7 tasks on 16 devices 121.1 ms against 123.0, on 32
        devices 82.4 against 80.35).
        What it saves is mostly the kept plan's wait for transfers, so a schedule that
        computes longer than the kept plan's compute and transfer wait together is not
        simulated: a cut-off for planning time, since a task-stable plan could also sync
        faster (with the balanced counts alone it skipped 61 of the 88 schedules that
        multitask-clip's memory settings make in `spindle bench`, and every bench plan was
        the same as without it). The neighbours are tried only when a schedule of the
        balanced counts became the best plan or simulated within NEAR_BEST of it: the
        neighbours differ from it by one device per task, so a near tie may tip (OFASys 7 tasks
        on 16 devices under the chunked buckets: the balanced counts 128.3 ms, the kept plan
        127.4, a neighbour 125.5)."""
        assert self.best is not None
        graph, curves, n_dev = self.graph, self.curves, self.n_dev
        all_sizes = self.schedules.made(("task sizes",), None, task_sizes, graph, curves, n_dev)
        for k, sizes in enumerate(all_sizes):
            stable = self.schedules.made(("task-stable", tuple(sizes)), None, task_stable,
                                         self.allocs, graph, curves, self.cluster, sizes)
            bar_ms = self.best.compute_and_wait_ms
            kept = near = False
            for extend in (True, False):
                planned = self.schedules.made(("task-stable", tuple(sizes), extend),
                                              self.max_ops, fused_waves, graph, curves,
                                              stable.allocs, n_dev, extend=extend)
                label = "task-stable" if extend else "task-stable, no extension"
                if compute_ms(planned) >= bar_ms:
                    continue
                if self.consider(self.whole_cluster, planned, fused=True, label=label,
                                 slack=NEAR_BEST if k == 0 else 0.0):
                    kept = True
                    self.consider(self.whole_cluster, planned, fused=True, home=stable.home,
                                  label=f"{label}, home ranks")
                near = near or self.last_ms <= self.best.iteration_ms * (1 + NEAR_BEST)
            if k == 0 and not (kept or near):
                return

    def consider_lanes(self) -> None:
        """Tasks one after another on lanes of equal device groups, each task on its lane's
        ranks (`tasks.task_lanes`), for clusters with fewer groups than tasks (tiny-clip's 4
        tasks on 2 CPU ranks: no rows between ranks until the gradient sync). Like the
        task-stable schedules, simulated only when the lanes' compute is below the kept
        plan's compute and transfer wait."""
        assert self.best is not None
        all_lanes = self.schedules.made(("task lanes",), None, task_lanes, self.graph,
                                        self.curves, self.cluster)
        for i, lanes in enumerate(all_lanes):
            bar_ms = self.best.compute_and_wait_ms
            if lanes.load_ms >= bar_ms:
                continue
            planned, home = self.schedules.made(("task lanes", i), self.max_ops, lane_waves,
                                                self.graph, self.curves, lanes)
            if compute_ms(planned) < bar_ms:
                self.consider(self.whole_cluster, planned, fused=True, home=home,
                              label=f"task lanes of {lanes.size}")

    def consider_baselines(self) -> None:
        """The three baselines' schedules, so that Spindle never simulates slower than a
        baseline (tried, where simulated, even where none of Spindle's own fits: one may; a
        quality sweep of 132 small cases found 11 where a baseline's schedule beat every one
        of Spindle's own by 0.5-12%: an embedding's rows re-split between 3 and 1 devices, or,
        before the forward waited for the ZeRO all-gather layer by layer, a 32-layer encoder
        waiting in one wave for all of it across nodes). Each plan assembled goes to
        `baseline_plans`, which `api.fitting_plan_with_cost` tries with finer chunks."""
        graph, curves, n_dev, max_ops = self.graph, self.curves, self.n_dev, self.max_ops
        for name, planned in (("sequential", baselines.sequential(graph, curves, max_ops)),
                              ("optimus", baselines.optimus(graph, curves, n_dev, max_ops)),
                              ("distmm", baselines.distmm(graph, curves, n_dev, max_ops))):
            # simulated to the end within NEAR_BEST: a runner-up may gain more from finer
            # gradient chunks (`api.fitting_plan_with_cost`)
            self.consider(self.whole_cluster, planned, fused=True, label=f"{name}'s schedule",
                          slack=NEAR_BEST)
            plan = self.tried.get(_key(planned))
            if self.baseline_plans is not None and plan is not None:
                self.baseline_plans.append(plan)

    def consider_placed_again(self, own: _Kept | None) -> list[tuple[float, Plan]]:
        """The kept plan's waves placed again with ranks reserved for the slices that would
        keep their rows there (`placement.place`'s `reserve`), kept when that simulates
        faster (in `spindle bench`, with the memory search: OFASys 4 tasks on 8 GPUs 108.4 ms
        instead of 110.1, multitask-clip 7 tasks on 32 GPUs 105.2 instead of 109.9; 12 of the
        17 cells below 256 GPUs gain), and on consecutive ranks as the sequential baseline
        places them, kept when that simulates faster: island placement weighs inter-wave
        flows, not where the gradient rings run (qwen-val on 64 GPUs: 716.1 ms on consecutive
        ranks against 726.0, with less sync); when a baseline's schedule is kept, Spindle's
        own best (`own`, if any fits) is placed those two ways as well (OFASys-small's
        audio_asr and region_caption on 16-GiB devices: 18.02 ms against optimus's 18.78).
        Returns Spindle's own best and its placements simulated to the end, with their
        iterations."""
        assert self.best is not None
        mine = [] if own is None else [(own.iteration_ms, own.plan)]
        for kept in (self.best,) if own in (self.best, None) else (self.best, own):
            ways: list[dict[str, Any]] = [{"home": kept.home, "reserve": kept.plan,
                                           "label": _labelled(kept.label, "reserved ranks")}]
            if self.options.placement == "island":
                ways.append({"label": _labelled(kept.label, "consecutive ranks"),
                             "consecutive": True})
            for way in ways:
                self.consider(kept.caps, kept.planned, spread=kept.spread, fused=kept.fused,
                              **way)
                if kept is own and self.last_plan is not None:
                    mine.append((self.last_ms, self.last_plan))
        return mine

    def finer_chunks_of_both(self, mine: list[tuple[float, Plan]]) -> tuple[Plan, float]:
        """Where a baseline's schedule is still the best, it and Spindle's own best (the
        fastest of `mine`) with finer gradient chunks (`finer_chunks`, which
        `api.fitting_plan_with_cost` tries on the kept plan only): Spindle's own may gain more
        from them (a sweep case, multitask-clip's vision-text task on 2 nodes of 6 GPUs under
        ZeRO-1: Spindle's own 64.11 ms with 16 chunks, where DistMM-MT's schedule was kept at
        67.49 with 4). The faster, with its simulated iteration."""
        best = self.best
        assert best is not None
        graph, profile, cluster = self.graph, self.profile, self.cluster
        theirs = finer_chunks((best.iteration_ms, best.plan), graph, profile, cluster,
                              give_up_ms=self.give_up_ms)
        ours = (finer_chunks(min(mine, key=lambda m: m[0]), graph, profile, cluster,
                             give_up_ms=theirs[0]) if mine else theirs)
        kept_ms, kept_plan = ours if ours[0] < theirs[0] - 1e-9 else theirs
        return kept_plan, kept_ms


def _labelled(label: str, more: str) -> str:
    """A kept candidate's label with what was done to it added."""
    return f"{label}, {more}" if label else more


SYNC_CHUNK_CHOICES = (8, 16)
"""The gradient chunk counts per wave (Plan.options `sync_chunks`) that
`api.fitting_plan_with_cost` tries on the kept plan, besides `buckets.MAX_CHUNKS`. In
`benchmarks/bench_sweep.py` adding 16 to 8 made 12 of 132 cases 0.2-1.4% faster and none
slower; adding 2 as well, 1 case 0.3%."""


def finer_chunks(best: tuple[float, Plan], graph: MetaOpGraph, profile: Profile,
                 cluster: ClusterSpec, *, give_up_ms: float = math.inf) -> tuple[float, Plan]:
    """The kept plan (its simulated iteration, the plan) with its gradient buckets cut into
    more chunks per wave (`SYNC_CHUNK_CHOICES`), where that simulates faster: more collectives,
    each paying its ring's message latencies, but each starting sooner in the backward (and,
    under ZeRO-1/2, its all-gather arriving sooner in the next forward). The same plan
    otherwise, for every planner alike: how the executor buckets a plan's gradients. Finer
    chunks are simulated only until they pass the best iteration so far or `give_up_ms`; a
    count that cuts the buckets as a count before it did (every chunk at its least bytes,
    `buckets.SYNC_CHUNK_BYTES`) is not simulated again, nor one no finer than the plan's own
    (a plan `make_plan_with_cost` already tried them on)."""
    metaops = {m.id: m for m in graph.metaops}
    kept = best[1]
    layouts = [sync_buckets(kept, metaops, "chunked")]
    for count in SYNC_CHUNK_CHOICES:
        if count <= max_chunks(kept):
            continue
        options = replace(PlanOptions.of(kept), sync_chunks=count)
        plan = replace(kept, options=options.as_dict())
        layout = sync_buckets(plan, metaops, "chunked")
        if layout in layouts:
            continue
        layouts.append(layout)
        cost = simulated_cost(plan, graph, profile, cluster,
                              give_up_ms=min(best[0], give_up_ms))
        if math.isfinite(cost.transfer_ms) and cost.iteration_ms < best[0] - 1e-9:
            best = (cost.iteration_ms, plan)
    return best
