"""The evaluation matrix of the paper (Figs. 8, 10, 11, 12) and dynamic task sets, as rows of
data: every configuration is graph -> analytic profile -> plan (each planner) -> simulate.

Pure apart from reading the clock: models and clusters come in as objects, and nothing is
printed or written (the `spindle bench` command does that).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.io import as_written
from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.plan import Plan
from spindle_cli.artifacts.profile import Profile
from spindle_cli.errors import PlanInfeasible, SpindleError
from spindle_cli.planner import paper_numbers
from spindle_cli.planner.api import fitting_plan_with_cost
from spindle_cli.planner.assemble import place_again
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.schedules import allocate, op_curves
from spindle_cli.planner.simulate import SimResult, simulate

HARDWARE = "a800"
"""Analytic device model of every profile (the paper's cluster)."""

CLUSTERS = {8: "a800-1x8", 16: "a800-2x8", 32: "a800-4x8", 64: "a800-8x8", 256: "a800-32x8"}
"""Device count -> the shipped cluster spec it runs on."""

VARIANTS: tuple[tuple[str, str], ...] = (
    ("spindle", "island"),
    ("spindle", "sequential"),
    ("sequential", "island"),
    ("optimus", "island"),
    ("distmm", "island"),
)
"""(planner, placement) of every plan made per configuration; spindle with sequential
placement is a plan made for that placement (Fig. 10's ablation proper, the kept waves placed
sequentially, is the island row's `naive_transfer_fraction`)."""

OPTIMUM = "optimum"
"""Planner name of the relaxed-optimum row (sum over MetaLevels of C*, compute only)."""

DYNAMIC_MODEL = "multitask-clip"
DYNAMIC_SCHEDULE = ("4", "7", "10", "7")
"""Task sets of DYNAMIC_MODEL that follow each other in `--dynamic`."""
DYNAMIC_DEVICES = 32
"""Cluster size of `--dynamic`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One cell of the matrix: a model's task set on a cluster size."""

    model: str
    task_set: str | None
    """Name in the model's task_sets; None for all of its tasks."""
    num_tasks: int
    num_devices: int

    @property
    def cluster(self) -> str:
        """Name of the cluster spec."""
        return CLUSTERS[self.num_devices]

    def tasks(self, model: ModelSpec) -> list[str] | None:
        """The task names to build the graph from."""
        return None if self.task_set is None else list(model.task_sets[self.task_set])


def matrix(*, quick: bool = False) -> list[BenchConfig]:
    """The paper's evaluation matrix (Fig. 8), or a three-cell sample with `quick`."""
    if quick:
        return [BenchConfig(model="multitask-clip", task_set="4", num_tasks=4, num_devices=16),
                BenchConfig(model="ofasys", task_set="7", num_tasks=7, num_devices=16),
                BenchConfig(model="qwen-val", task_set=None, num_tasks=3, num_devices=32)]
    cells = [BenchConfig(model="multitask-clip", task_set=str(k), num_tasks=k, num_devices=n)
             for k in (4, 7, 10) for n in (8, 16, 32)]
    cells += [BenchConfig(model="ofasys", task_set=str(k), num_tasks=k, num_devices=n)
              for k in (4, 7) for n in (8, 16, 32)]
    cells += [BenchConfig(model="qwen-val", task_set=None, num_tasks=3, num_devices=n)
              for n in (32, 64)]
    cells += [BenchConfig(model=m, task_set=None, num_tasks=3, num_devices=256)
              for m in ("qwen-val-30b", "qwen-val-70b")]
    return cells


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRow:
    """One planner on one configuration. Measured fields are None when planning failed
    (`error` says why)."""

    model: str
    num_tasks: int
    num_devices: int
    cluster: str
    planner: str
    placement: str
    iteration_ms: float | None
    """Simulated iteration (for `optimum`: the relaxed optimum itself)."""
    executed_ms: float | None
    """The same plan simulated with each rank on its own (`simulate`'s progress 'rank'), as
    `spindle run` executes it, instead of wave by wave."""
    speedup_vs_sequential: float | None
    lower_bound_ms: float | None
    """Relaxed optimum sum of C* (compute only)."""
    gap_to_optimum: float | None
    """iteration_ms / lower_bound_ms."""
    compute_gap: float | None
    """Simulated compute (wave durations) / lower_bound_ms: the schedule's own gap."""
    compute_ms: float | None
    transfer_ms: float | None
    sync_ms: float | None
    gather_wait_ms: float | None
    """The part of sync_ms the waves waited for ZeRO's parameter all-gathers
    (`SimResult.gather_wait_ms`)."""
    transfer_fraction: float | None
    """Exposed inter-wave transfer time / iteration time."""
    naive_transfer_fraction: float | None
    """Spindle's kept waves placed on consecutive ranks instead (`assemble.place_again` with
    'sequential'): the transfer share of Fig. 10's ablation, the schedule held fixed. Only on
    the spindle row with island placement; None elsewhere or when those waves do not fit
    placed that way (`naive_error`)."""
    naive_iteration_ms: float | None
    """The simulated iteration of those re-placed waves."""
    naive_error: str
    """Why the kept waves cannot be placed sequentially ('' when they can, or off that row)."""
    idle_fraction: float | None
    """Share of device time not computing."""
    inter_island_bytes: int | None
    peak_memory_bytes: int | None
    planned_iteration_ms: float | None
    memory: str
    """The memory setting of the kept plan: 'zero<k>' and/or 'recompute', or 'none'."""
    candidate: str
    """Which of the spindle planner's candidates was kept (Plan.candidate; '' otherwise)."""
    plan_seconds: float | None
    """Seconds `spindle plan` spends planning this configuration: the whole search over
    memory settings (`plan_and_simulate`), reading and writing files not counted; where it
    cannot plan, the seconds until it says so (None where there was no profile to plan
    from)."""
    paper_speedup: float | None
    """The paper's speedup over DeepSpeed for this planner and cell (Fig. 8), if any."""
    paper_transfer_share: float | None
    """The paper's inter-wave share for Spindle with its own placement (Fig. 10), if any; it
    compares with `transfer_fraction`. Only on the spindle row with island placement."""
    paper_naive_transfer_share: float | None
    """The paper's inter-wave share for Spindle without its placement (Fig. 10), if any: the
    schedule held fixed, so it compares with `naive_transfer_fraction`, on the same row. The
    paper has no figure for a plan made for sequential placement."""
    error: str = ""


def profile_for(graph: MetaOpGraph, cluster: ClusterSpec) -> Profile:
    """Analytic a800 curves at every power of two up to the cluster size, as `spindle profile
    GRAPH --hardware a800 --cluster CLUSTER --counts 1,2,4,...` writes them."""
    n = cluster.num_devices
    counts = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return as_written(analytic_profile(graph, cluster, hardware=HARDWARE, counts=counts))


def lower_bound_ms(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec) -> float:
    """The relaxed optimum of the allocator: the sum over MetaLevels of C*."""
    curves = op_curves(graph, profile, cluster.num_devices, island_size=cluster.island_size)
    return math.fsum(a.lower_bound_ms for a in allocate(graph, curves, cluster.num_devices))


def plan_and_simulate(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                      planner: str, placement: str) -> tuple[Plan, SimResult, float]:
    """Plan with one planner as `spindle plan --memory auto --recompute auto` does
    (`api.fitting_plan_with_cost`: every ZeRO stage 0-3, with and without recomputation, the
    plan that simulates fastest kept) and simulate the plan as written; returns the plan, its
    simulation and the seconds that whole search took. The same search for every planner
    stands for the paper's hand-tuned ZeRO stage and checkpointing of the baselines."""
    options = PlanOptions(planner=planner, placement=placement)
    start = time.perf_counter()
    plan, _ = fitting_plan_with_cost(graph, profile, cluster, options=options)
    seconds = time.perf_counter() - start
    plan = as_written(plan)
    return plan, simulate(plan, graph, profile, cluster), seconds


def naive_placement(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                    ) -> tuple[SimResult | None, str]:
    """The simulation of `plan`'s waves placed on consecutive ranks (`assemble.place_again`), or
    None and why they do not fit that way."""
    try:
        again = place_again(plan, graph, profile, cluster, placement="sequential")
    except PlanInfeasible as e:
        return None, str(e)
    return simulate(again, graph, profile, cluster), ""


def memory_setting(plan: Plan) -> str:
    """'zero<k>', 'recompute', both joined by '+', or 'none', from the plan's options."""
    parts = []
    if plan.options.get("zero", "0") != "0":
        parts.append(f"zero{plan.options['zero']}")
    if plan.options.get("recompute", "false") == "true":
        parts.append("recompute")
    return "+".join(parts) or "none"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def config_graph(model: ModelSpec, config: BenchConfig) -> MetaOpGraph:
    """The configuration's graph as `spindle graph` writes it (numbers rounded as in the file)."""
    return as_written(build_graph(model, tasks=config.tasks(model)))


def run_config(model: ModelSpec, cluster: ClusterSpec, config: BenchConfig) -> list[BenchRow]:
    """Every variant's row plus the optimum's, for one configuration."""
    graph = config_graph(model, config)
    # (planner, placement, kept plan, its simulation, planning seconds, error)
    results: list[tuple[str, str, Plan | None, SimResult | None, float | None, str]] = []
    try:
        profile = profile_for(graph, cluster)
    except SpindleError as e:
        # no curves on this cluster (a MetaOp fits no count of its devices): every variant
        # fails alike, and the other configurations go on
        results = [(planner, placement, None, None, None, f"profile: {e}")
                   for planner, placement in VARIANTS]
        bound: float | None = None
    else:
        try:
            bound = lower_bound_ms(graph, profile, cluster)
        except SpindleError:
            bound = None
        for planner, placement in VARIANTS:
            start = time.perf_counter()
            try:
                plan, sim, seconds = plan_and_simulate(graph, profile, cluster, planner,
                                                       placement)
                results.append((planner, placement, plan, sim, seconds, ""))
            except SpindleError as e:
                # how long `spindle plan` takes to say it cannot
                results.append((planner, placement, None, None, time.perf_counter() - start,
                                str(e)))
    baseline = next((s.iteration_ms for p, _, _, s, _, _ in results
                     if p == "sequential" and s is not None), None)
    key = (config.model, config.num_tasks, config.num_devices)
    rows = []
    for planner, placement, plan, sim, seconds, error in results:
        spindle_island = (planner, placement) == ("spindle", "island")
        it = sim.iteration_ms if sim else None
        executed = (simulate(plan, graph, profile, cluster, progress="rank").iteration_ms
                    if plan else None)
        naive, naive_error = (naive_placement(plan, graph, profile, cluster)
                              if plan and spindle_island else (None, ""))
        rows.append(BenchRow(
            model=config.model, num_tasks=config.num_tasks, num_devices=config.num_devices,
            cluster=cluster.name, planner=planner, placement=placement, iteration_ms=it,
            executed_ms=executed, speedup_vs_sequential=_ratio(baseline, it), lower_bound_ms=bound,
            gap_to_optimum=_ratio(it, bound),
            compute_gap=_ratio(sim.compute_ms, bound) if sim else None,
            compute_ms=sim.compute_ms if sim else None,
            transfer_ms=sim.transfer_ms if sim else None,
            sync_ms=sim.sync_ms if sim else None,
            gather_wait_ms=sim.gather_wait_ms if sim else None,
            transfer_fraction=sim.transfer_fraction if sim else None,
            naive_transfer_fraction=naive.transfer_fraction if naive else None,
            naive_iteration_ms=naive.iteration_ms if naive else None,
            naive_error=naive_error,
            idle_fraction=sim.idle_fraction if sim else None,
            inter_island_bytes=sim.inter_island_bytes if sim else None,
            peak_memory_bytes=sim.peak_memory_bytes if sim else None,
            planned_iteration_ms=sim.planned_iteration_ms if sim else None,
            memory=memory_setting(plan) if plan else "-",
            candidate=plan.candidate if plan else "", plan_seconds=seconds,
            paper_speedup=paper_numbers.speedup(*key, planner) if placement == "island" else None,
            paper_transfer_share=paper_numbers.transfer_share(*key, "island")
            if spindle_island else None,
            paper_naive_transfer_share=paper_numbers.transfer_share(*key, "sequential")
            if spindle_island else None,
            error=error,
        ))
    rows.append(BenchRow(
        model=config.model, num_tasks=config.num_tasks, num_devices=config.num_devices,
        cluster=cluster.name, planner=OPTIMUM, placement="-", iteration_ms=bound,
        executed_ms=None, speedup_vs_sequential=_ratio(baseline, bound), lower_bound_ms=bound,
        gap_to_optimum=1.0 if bound else None, compute_gap=1.0 if bound else None,
        compute_ms=bound, transfer_ms=None, sync_ms=None, gather_wait_ms=None,
        transfer_fraction=None,
        naive_transfer_fraction=None, naive_iteration_ms=None, naive_error="",
        idle_fraction=None, inter_island_bytes=None, peak_memory_bytes=None,
        planned_iteration_ms=None, memory="-", candidate="", plan_seconds=None,
        paper_speedup=None, paper_transfer_share=None, paper_naive_transfer_share=None,
        error="" if bound is not None else "no relaxed optimum (no valid allocation)",
    ))
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicRow:
    """One phase of the dynamic schedule under one planner."""

    planner: str
    phase: int
    task_set: str
    num_tasks: int
    iterations: int
    iteration_ms: float | None
    phase_ms: float | None
    """iterations x iteration_ms."""
    replan_seconds: float | None
    """Time to make the new plan when the task set changed: `spindle plan`'s whole search over
    memory settings (`plan_and_simulate`; graphs and curves are prepared offline). 0 for the
    first phase, planned before training starts, and for a task set an earlier phase ran,
    whose plan is kept."""
    error: str = ""


def run_dynamic(model: ModelSpec, cluster: ClusterSpec, *,
                schedule: tuple[str, ...] = DYNAMIC_SCHEDULE,
                iterations_per_phase: int = 100,
                planners: tuple[str, ...] = ("spindle", "sequential", "optimus", "distmm"),
                ) -> list[DynamicRow]:
    """Train `iterations_per_phase` iterations on each task set in turn, replanning at each
    change to a task set not run before (one run before keeps its plan), under every planner.
    KeyError for a task set the model does not have."""
    prepared = {}
    for name in schedule:
        if name not in prepared:
            graph = as_written(build_graph(model, tasks=list(model.task_sets[name])))
            prepared[name] = (graph, profile_for(graph, cluster))
    rows = []
    for planner in planners:
        made: dict[str, tuple[SimResult, float] | SpindleError] = {}
        for phase, name in enumerate(schedule):
            graph, profile = prepared[name]
            first = name not in made
            if first:
                try:
                    _, sim, seconds = plan_and_simulate(graph, profile, cluster, planner,
                                                        "island")
                    made[name] = sim, seconds
                except SpindleError as e:
                    made[name] = e
            result = made[name]
            if isinstance(result, SpindleError):
                rows.append(DynamicRow(planner=planner, phase=phase, task_set=name,
                                       num_tasks=len(graph.tasks), iterations=iterations_per_phase,
                                       iteration_ms=None, phase_ms=None, replan_seconds=None,
                                       error=str(result)))
                continue
            sim, seconds = result
            rows.append(DynamicRow(
                planner=planner, phase=phase, task_set=name, num_tasks=len(graph.tasks),
                iterations=iterations_per_phase, iteration_ms=sim.iteration_ms,
                phase_ms=sim.iteration_ms * iterations_per_phase,
                replan_seconds=seconds if first and phase > 0 else 0.0))
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicTotal:
    """The whole dynamic schedule under one planner."""

    planner: str
    train_s: float | None
    """Simulated training time of every phase; None when a phase could not be planned."""
    replan_s: float
    """Replanning time of the phases that could be planned (their `replan_seconds`)."""
    total_s: float | None
    """train_s + replan_s; None with train_s."""
    spindle_ahead_beyond: float | None = None
    """Iterations per phase beyond which Spindle's total is below this planner's: Spindle's
    iterations are shorter and its replanning longer, so longer phases pay for the
    replanning (0 when its replanning is no longer; None for Spindle itself, without a
    Spindle total, or when Spindle trains no faster)."""


def dynamic_totals(rows: list[DynamicRow]) -> list[DynamicTotal]:
    """Sum each planner's phases (training + replanning)."""
    out = []
    for planner in dict.fromkeys(r.planner for r in rows):
        mine = [r for r in rows if r.planner == planner]
        replan = math.fsum(r.replan_seconds or 0.0 for r in mine)
        if any(r.phase_ms is None for r in mine):
            out.append(DynamicTotal(planner=planner, train_s=None, replan_s=replan, total_s=None))
            continue
        train = math.fsum(r.phase_ms or 0.0 for r in mine) / 1e3
        out.append(DynamicTotal(planner=planner, train_s=train, replan_s=replan,
                                total_s=train + replan))
    spindle = next((t for t in out if t.planner == "spindle" and t.train_s is not None), None)
    if spindle is None:
        return out
    iterations = next(r.iterations for r in rows if r.planner == "spindle")
    return [replace(t, spindle_ahead_beyond=_ahead_beyond(spindle, t, iterations)) for t in out]


def _ahead_beyond(spindle: DynamicTotal, other: DynamicTotal, iterations: int) -> float | None:
    """`DynamicTotal.spindle_ahead_beyond` of `other`, both run `iterations` per phase."""
    if other is spindle or other.train_s is None or spindle.train_s is None:
        return None
    saved_s = (other.train_s - spindle.train_s) / iterations  # per iteration of every phase
    if saved_s <= 0:
        return None
    return max(spindle.replan_s - other.replan_s, 0.0) / saved_s
