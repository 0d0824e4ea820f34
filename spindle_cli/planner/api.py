"""`make_plan`: graph + profile + cluster -> Plan. Composes allocation, waves (or a baseline),
placement and memory accounting; does no I/O. `make_fitting_plan`: the same under the memory
settings of `memory_ladder` (ZeRO stages, recomputation), keeping the plan that fits and
simulates fastest.

The plan's semantics (slices, transfers, parameter groups) are fixed in docs/CONTRACTS.md.
What does not live here: the options (`options.py`), the curves, allocations and wave
schedules (`schedules.py`), Spindle's candidate plans (`search.py`) and their assembly into a
Plan (`assemble.py`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.plan import ZERO_STAGES, Plan
from spindle_cli.artifacts.profile import Profile
from spindle_cli.errors import NoValidCount, OutOfMemory, PlanInfeasible, SplitGroup
from spindle_cli.planner.allocation import OpCurve
from spindle_cli.planner.buckets import backend_sync
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.schedules import Schedules
from spindle_cli.planner.search import (
    NEAR_BEST,
    SIMULATED_CHOICE_MAX_DEVICES,
    finer_chunks,
    make_plan_with_cost,
)
from spindle_cli.planner.simulate import simulated_cost


def make_plan(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
              options: PlanOptions = PlanOptions(), inputs: tuple[InputRef, ...] = ()) -> Plan:
    """`make_plan_with_cost`'s plan."""
    return make_plan_with_cost(graph, profile, cluster, options=options, inputs=inputs)[0]


MEMORY_MODES = ("auto", "none", "zero1", "zero2", "zero3")
RECOMPUTE_MODES = ("auto", "on", "off")


def memory_ladder(memory: str = "auto", recompute: str = "auto") -> tuple[tuple[int, bool], ...]:
    """The (ZeRO stage, recompute) settings to try, least aggressive first: every allowed ZeRO
    stage without recomputation, then with it. Recomputation comes last because it always
    costs a third more compute, while sharding costs only communication that overlaps (where
    memory limits no setting without it, Spindle tries only the baselines' schedules under it:
    `fitting_plan_with_cost`)."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"unknown memory mode {memory!r} (expected one of {MEMORY_MODES})")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {recompute!r} "
                         f"(expected one of {RECOMPUTE_MODES})")
    stages = ZERO_STAGES if memory == "auto" else (MEMORY_MODES.index(memory) - 1,)
    flags = {"auto": (False, True), "on": (True,), "off": (False,)}[recompute]
    return tuple((z, r) for r in flags for z in stages)


def make_fitting_plan(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                      options: PlanOptions = PlanOptions(),
                      ladder: tuple[tuple[int, bool], ...] = memory_ladder(),
                      inputs: tuple[InputRef, ...] = ()) -> Plan:
    """`fitting_plan_with_cost`'s plan."""
    return fitting_plan_with_cost(graph, profile, cluster, options=options, ladder=ladder,
                                  inputs=inputs)[0]


def fitting_plan_with_cost(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                           options: PlanOptions = PlanOptions(),
                           ladder: tuple[tuple[int, bool], ...] = memory_ladder(),
                           inputs: tuple[InputRef, ...] = ()) -> tuple[Plan, float | None]:
    """`_fitting_plan_with_cost`; with uneven splits, Spindle also plans with even ones only
    and keeps that plan (its options say so) where it simulates faster, or where no plan
    with uneven splits fits: they widen the counts a MetaOp may take, but the search over
    them is heuristic and could keep a slower plan (multitask-clip 10 tasks on 32 GPUs:
    107.01 ms against even splits' 103.85; 16 GPUs: 139.20 against 138.51)."""
    if not options.uneven_splits or options.planner != "spindle":
        return _fitting_plan_with_cost(graph, profile, cluster, options=options, ladder=ladder,
                                       inputs=inputs)
    def planned(splits: PlanOptions) -> tuple[Plan, float | None]:
        return _fitting_plan_with_cost(graph, profile, cluster, options=splits, ladder=ladder,
                                       inputs=inputs)

    even = replace(options, uneven_splits=False)
    try:
        plan, iteration_ms = planned(options)
    except PlanInfeasible as uneven:
        try:
            return planned(even)
        except PlanInfeasible:
            raise uneven from None
    if iteration_ms is not None:  # None above SIMULATED_CHOICE_MAX_DEVICES: nothing to compare
        with contextlib.suppress(PlanInfeasible):
            other, other_ms = planned(even)
            if other_ms is not None and other_ms < iteration_ms - 1e-9:
                return other, other_ms
    return plan, iteration_ms


SEED_MARGIN = 0.25
"""How much slower than the best plan of an earlier memory setting a candidate is still
simulated to the end (`fitting_plan_with_cost`): it cannot be kept, but as the kept plan of
its own setting it seeds candidates (rebuilt lighter, under other bounds, placed again) that
may beat that plan; one simulated only up to that plan seeds them from a mere lower bound
(OFASys 7 tasks on 16 GPUs then kept a plan 1.1% slower)."""


def _fitting_plan_with_cost(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                            options: PlanOptions, ladder: tuple[tuple[int, bool], ...],
                            inputs: tuple[InputRef, ...]) -> tuple[Plan, float | None]:
    """The plan and its simulated iteration (ms; None where it is not simulated, see below) of
    `make_plan` under the (ZeRO stage, recompute) settings of `ladder` that fit (the options' own
    `zero` and `recompute` are replaced), keeping the plan that simulates fastest; on ties the
    earlier, less aggressive setting. Fitting is not enough: a setting that fits may fit only a slow
    plan (qwen-val-70b on 256 devices fits under ZeRO-1 only with every LLM slice on one node, 14 s,
    while ZeRO-2 fits a 5 s plan), and ZeRO-3's weight gathers can cost more than recomputation's
    extra forward. A setting is skipped without planning when `compute_bound_ms` under it (a lower
    bound of any plan's simulated iteration, its levels fused or not) is no shorter than the best
    plan's simulated iteration. Where every setting of the ladder without recomputation fits and
    device memory limited none of their searches (`make_plan_with_cost`'s `limited`: no candidate
    out of memory, no slice at its memory limit below its MetaOp's operators, none kept off a free
    rank for memory), recomputation only adds compute: Spindle tries only the baselines' schedules
    under it (then the kept one placed again and with finer chunks, as at the end of its whole
    search), as the baselines' own searches do, so it still never simulates slower than a baseline
    (the recomputed curves change a baseline's plan: Optimus and DistMM each keep recomputation in a
    sweep case where memory does not bind). In the 132 sweep cases, the 17 bench cells below 256
    GPUs and multitask-clip 10 tasks on 64 every planner's plan stayed byte-identical and Spindle
    planned them in 0.77-0.85x the time (two runs; multitask-clip 10 tasks on 64 GPUs 2.3-3.2 s
    against 4.2-5.6, alternating runs); so did Spindle's, before the placed-again step, in 516 cases
    of tight memory, where it kept recomputation in 200 (the sweep's cases with each device's memory
    at 60, 80 and 95% of the peak of its ZeRO-0 plan, and 60 of them at 60 and 80% under `--memory
    none`). The settings with the same recomputation flag share their curves, allocations and wave
    schedules (`Schedules`), and Spindle's own simulation of its kept candidate is the setting's
    cost; a setting's candidates are simulated only up to SEED_MARGIN above the best plan so far (in
    `spindle bench`, the same plans in 0.83x the time; OFASys 7 tasks on 32 GPUs 3.5 s instead of
    5.5). On a cluster whose gradient buckets are chunked (nccl) the kept plan is then tried with
    finer chunks (`finer_chunks`), and so are the FINER_RUNNERS_UP fastest candidates of other
    waves, of any setting, that simulated within NEAR_BEST of it (`_runners_up`; the baselines'
    schedules are simulated to the end there for it): one may gain more (in the quality sweep 8
    cases 0.1-2.7% faster). Above SIMULATED_CHOICE_MAX_DEVICES the first setting that fits is kept
    (its plan the fastest of a few simulated candidates; simulating every setting there would
    outlast the planning target). PlanInfeasible from the last setting when none fits."""
    if not ladder:
        raise ValueError("empty memory ladder")
    error: PlanInfeasible | None = None
    best: tuple[float, Plan] | None = None
    shared: dict[bool, Schedules] = {}
    finished: list[tuple[float, Plan]] = []
    baseline_plans: list[Plan] = []
    binding = MemoryBinding(ladder)
    for zero, recompute in ladder:
        own = binding.own(recompute)
        trial = replace(options, zero=zero, recompute=recompute)
        try:
            if recompute not in shared:
                shared[recompute] = Schedules(graph, profile, cluster, trial, inputs=inputs)
            if best is not None and compute_bound_ms(
                    graph, shared[recompute].curves, cluster.num_devices) >= best[0]:
                continue
            plan, iteration_ms = make_plan_with_cost(
                graph, profile, cluster, options=trial, inputs=inputs,
                schedules=shared[recompute],
                give_up_ms=best[0] * (1 + SEED_MARGIN) if best else math.inf,
                finished=finished, baseline_plans=baseline_plans, own=own,
                limited=binding.limits(recompute))
        except PlanInfeasible as e:
            error = e
            binding.unfit(recompute)
            continue
        if cluster.num_devices > SIMULATED_CHOICE_MAX_DEVICES:
            return plan, None
        if iteration_ms is None:
            iteration_ms = simulated_cost(plan, graph, profile, cluster,
                                          give_up_ms=best[0] if best else math.inf).iteration_ms
        if best is None or iteration_ms < best[0] - 1e-9:
            best = (iteration_ms, plan)
    if best is not None and backend_sync(cluster.backend) == "chunked":
        # the kept plan and the next fastest candidates of other waves: one may gain more. And
        # as a baseline's own search tries them on its kept plan however far behind Spindle's
        # its schedule simulated here, so are the baselines' schedules of every setting (the
        # best so far given as the one to beat), each finer count simulated only until it
        # passes the best
        candidates = [best, *_runners_up(best, finished)]
        for plan in baseline_plans:
            # two baselines with the same waves record the same plan: tried once
            if not any(plan is c[1] for c in candidates):
                candidates.append((best[0], plan))
        for candidate in candidates:
            finer = finer_chunks(candidate, graph, profile, cluster, give_up_ms=best[0])
            if finer[0] < best[0] - 1e-9:
                best = finer
    if best is None:
        assert error is not None
        if isinstance(error, (NoValidCount, SplitGroup)):
            raise error  # no memory setting changes the counts a curve allows, nor islands
        last = memory_setting(*ladder[-1])
        raise (OutOfMemory if isinstance(error, OutOfMemory) else PlanInfeasible)(
            f"{error} (with {last}, the last of {len(ladder)} memory settings tried)"
            if len(ladder) > 1 else f"{error} (with {last})",
            hint=error.hint or (
                "plan for more devices, or a smaller model or batch" if len(ladder) > 1 else
                "--memory auto --recompute auto tries every ZeRO stage, without and with "
                "recomputation; or plan for more devices")) from None
    return best[1], best[0]


class MemoryBinding:
    """Whether device memory binds the settings of a memory ladder without recomputation
    (`fitting_plan_with_cost`): where every one of them fits and memory limited none of their
    searches (`make_plan_with_cost`'s `limited`), recomputation only adds compute, and
    Spindle's own candidates skip it. Told of each setting as it is planned, in the ladder's
    order."""

    def __init__(self, ladder: tuple[tuple[int, bool], ...]) -> None:
        self.left = sum(not recompute for _, recompute in ladder)
        """The settings without recomputation not planned yet."""
        self.binds = self.left == 0
        """Whether one did not fit (or there is none: recomputation was asked for)."""
        self.limited: set[str] = set()
        """What memory limited in their searches."""

    def own(self, recompute: bool) -> bool:
        """Whether the next setting gets Spindle's own candidates (it counts as planned)."""
        if not recompute:
            self.left -= 1
            return True
        return self.binds or self.left > 0 or bool(self.limited)

    def limits(self, recompute: bool) -> set[str] | None:
        """Where a setting's search tells what memory limited (`make_plan_with_cost`'s
        `limited`)."""
        return None if recompute else self.limited

    def unfit(self, recompute: bool) -> None:
        """A setting did not fit."""
        self.binds = self.binds or not recompute


FINER_RUNNERS_UP = 2
"""How many candidates simulated within NEAR_BEST of the kept plan (any memory setting) are
tried with finer gradient chunks besides it (`fitting_plan_with_cost`): the fastest ones
whose waves differ from its and from each other's (the same waves under another ZeRO stage
often simulate alike and crowded out a baseline's schedule within 0.1% that gained 3.3%)."""


def _runners_up(best: tuple[float, Plan], finished: list[tuple[float, Plan]]
                ) -> list[tuple[float, Plan]]:
    """The FINER_RUNNERS_UP fastest of the candidates `finished` (simulated to the end, with
    their iterations) within NEAR_BEST of `best`, each with waves that differ from the kept
    plan's and the others'."""
    near: list[tuple[float, Plan]] = []
    for c in sorted(finished, key=lambda c: c[0]):
        if len(near) == FINER_RUNNERS_UP or c[0] > best[0] * (1 + NEAR_BEST):
            break
        if all(c[1].waves != other[1].waves for other in (best, *near)):
            near.append(c)
    return near


def compute_bound_ms(graph: MetaOpGraph, curves: dict[str, OpCurve], num_devices: int) -> float:
    """A lower bound of the compute of any schedule of `graph` on `num_devices`, whether its
    levels run between barriers or overlap (a fused plan, the optimus and distmm baselines,
    which the sum of the levels' C* does not bound): the larger of the work bound (every
    operator at its MetaOp's least device-time n T(n), spread over every device) and the
    longest dependency chain (every operator at its MetaOp's fastest time)."""
    work_ms = math.fsum(m.num_layers * min(n * t for n, t in zip(curves[m.id].counts[1:],
                                                           curves[m.id].times_ms[1:],
                                                           strict=True))
                  for m in graph.metaops)
    chain_ms: dict[str, float] = {}
    for m in sorted(graph.metaops, key=lambda m: m.level):
        chain_ms[m.id] = (m.num_layers * min(curves[m.id].times_ms)
                          + max((chain_ms[p] for p in m.predecessors), default=0.0))
    return max(work_ms / num_devices, max(chain_ms.values(), default=0.0))


def memory_setting(zero: int, recompute: bool) -> str:
    """'ZeRO-1', 'no ZeRO and recomputation', ... (a rung of `memory_ladder`)."""
    return (f"ZeRO-{zero}" if zero else "no ZeRO") + (" and recomputation" if recompute else "")
