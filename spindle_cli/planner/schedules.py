"""What `api.make_plan` builds before placement: every MetaOp's curve over the device counts a plan
may give it (`op_curves`, `options_curves`; under a device bound, `capped_curves`), the levels'
allocations (`allocate`), the slices' operator limits (`slice_limits`), Algorithm 1's wave
schedules made from them (`level_waves` level by level, `fused_waves` all levels at once;
`split_first_long_wave` splits one), and `Schedules`, which keeps them for the next plan of
the memory search.

What does not live here: choosing among the candidate schedules (`search.py`), placing them
and building the Plan (`assemble.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.profile import Curve, Profile, tp_degree
from spindle_cli.errors import FieldError, NoValidCount, PlanInfeasible, SpindleError
from spindle_cli.planner import scaling
from spindle_cli.planner.alignment import MaxOps, PlannedWave, compute_ms
from spindle_cli.planner.allocation import (
    AslTuple,
    LevelAllocation,
    OpCurve,
    allocate_level,
    op_curve,
    valid_counts,
)
from spindle_cli.planner.memory import NO_SAVING, MemoryStrategy, max_ops_per_slice
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import allowed_curve, tp_allowed
from spindle_cli.planner.shortening import shorten_waves
from spindle_cli.planner.waves import (
    LARGE_LEVEL,
    LARGE_LEVEL_VARIANTS,
    VARIANTS,
    TracedWaves,
    Variant,
    schedule_level,
    traced_wavefront_level,
    without_extension,
)
from spindle_cli.planner.workload import FORWARD_SHARE

RECOMPUTE_TIME_FACTOR = 1.0 + FORWARD_SHARE
"""Slice time under recomputation: one extra forward, the simulator's share of
forward+backward (1/3: the 1:2 FLOP ratio of planner/costs.py)."""


def _with_recompute(curve: Curve) -> Curve:
    """The curve with every time scaled by RECOMPUTE_TIME_FACTOR."""
    return replace(curve, pieces=tuple(
        replace(p, alpha_ms=p.alpha_ms * RECOMPUTE_TIME_FACTOR,
                beta_ms=p.beta_ms * RECOMPUTE_TIME_FACTOR) for p in curve.pieces))


def op_curves(graph: MetaOpGraph, profile: Profile, num_devices: int, *, uneven: bool = False,
              recompute: bool = False, tensor_parallel: bool = True,
              island_size: int | None = None,
              profile_name: str = "the profile") -> dict[str, OpCurve]:
    """Every MetaOp's curve restricted to its valid counts <= N (the data-parallel ones only
    without `tensor_parallel`; with `island_size`, no tensor-parallel degree that does not
    divide it: the curve fitted again without the strategies left out, `allowed_curve`;
    times with the extra forward of recomputation when asked). A tensor-parallel
    group stays inside one island, and when its degree divides the island size the islands
    split into whole groups: with islands of 3, three tp2 slices on 6 devices would need
    three islands; and a profile made for larger islands may hold degrees that fit in none."""
    counts_cache: dict[str, list[int]] = {}
    allowed: dict[str, Curve] = {}
    result = {}
    for m in graph.metaops:
        if m.signature not in allowed:
            try:
                allowed[m.signature] = allowed_curve(profile, m, tensor_parallel, island_size)
            except KeyError:
                raise SpindleError(
                    f"{profile_name} has no curve for signature {m.signature!r} (MetaOp "
                    f"{m.id})", hint="profile the same graph (spindle profile GRAPH ...)",
                ) from None
        curve = allowed[m.signature]
        if recompute:
            try:
                curve = _with_recompute(curve)
            except FieldError as e:
                raise SpindleError(
                    f"{profile_name}: curve {m.signature!r} (MetaOp {m.id}) with "
                    f"recomputation's extra forward: {e}",
                    hint="--recompute off, or check the profile's times") from None
        if m.signature not in counts_cache:
            counts_cache[m.signature] = planned_counts(
                curve, num_devices, uneven=uneven, tensor_parallel=tensor_parallel,
                island_size=island_size)
        oc = op_curve(m, curve, num_devices, counts_cache[m.signature], uneven=uneven)
        if len(oc.counts) == 1:
            below, hint = _count_refusal(curve, num_devices, uneven=uneven,
                                         tensor_parallel=tensor_parallel,
                                         island_size=island_size)
            raise NoValidCount(
                f"MetaOp {m.id} has no valid device count <= {num_devices} "
                f"(batch {curve.batch_size}, strategy {scaling.strategy(curve, 1)}"
                f"{_tp_refusal(curve, tensor_parallel, island_size)}){below}", hint=hint)
        result[m.id] = oc
    return result


def _count_refusal(curve: Curve, num_devices: int, *, uneven: bool, tensor_parallel: bool,
                   island_size: int | None) -> tuple[str, str | None]:
    """Why no count up to `num_devices` is valid for the curve's own reasons (`op_curves`'
    infeasibility message, after a colon: '' when there are none of them), and a hint when
    --uneven-splits would give a count: where the curve starts above 1, the profile's reasons
    for the counts below it (no memory setting of the planner brings those counts back: the
    profile has no time there; its notes say how it judged them); the counts on the curve
    that do not divide the batch."""
    low, high = scaling.count_range(curve)
    parts = []
    if low > 1:
        why: dict[int, str] = {}
        for p in sorted(curve.points, key=lambda p: (p.num_devices, p.strategy)):
            if p.num_devices < low and not p.feasible and p.note:
                why.setdefault(p.num_devices, p.note)
        found = ", ".join(f"{n} device{'s' if n > 1 else ''} {note}"
                          for n, note in why.items())
        parts.append(f"its curve starts at {low} devices"
                     + (f", the profile finding {found}" if why else ""))
    uneven_only = [] if uneven else [
        n for n in range(low, int(min(high, num_devices)) + 1)
        if scaling.is_valid(curve, n, uneven=True) and not scaling.is_valid(curve, n)
        and tp_allowed(tp_degree(scaling.strategy(curve, n)), tensor_parallel, island_size)]
    counts = ", ".join(map(str, uneven_only))
    if uneven_only:
        parts.append(f"{counts} {'does' if len(uneven_only) == 1 else 'do'} not divide the "
                     f"batch")
    hint = (f"--uneven-splits plans counts that do not divide the batch (here {counts})"
            if uneven_only else None)
    return (": " + "; ".join(parts) if parts else ""), hint


def _tp_refusal(curve: Curve, tensor_parallel: bool, island_size: int | None) -> str:
    """Why `op_curves` kept none of the curve's tensor-parallel counts ('' when it had none,
    or kept some), for its infeasibility message."""
    degrees = sorted({tp_degree(p.strategy) for p in curve.pieces} - {1})
    if not degrees:
        return ""
    if not tensor_parallel:
        return "; tensor parallelism is off"
    if island_size is not None and all(island_size % t for t in degrees):
        return (f"; no tensor-parallel degree of its curve ({', '.join(map(str, degrees))}) "
                f"divides the island size {island_size}")
    return ""


def planned_counts(curve: Curve, num_devices: int, *, uneven: bool, tensor_parallel: bool,
                   island_size: int | None) -> list[int]:
    """The valid counts <= N that `op_curves` offers `op_curve` for a MetaOp of `curve`: the
    data-parallel ones, and tensor-parallel ones where `tp_allowed` (op_curve then drops those
    no faster than a smaller one)."""
    return [n for n in valid_counts(curve, num_devices, uneven=uneven)
            if tp_allowed(tp_degree(scaling.strategy(curve, n)), tensor_parallel, island_size)]


def options_curves(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                   options: PlanOptions, *,
                   profile_name: str = "the profile") -> dict[str, OpCurve]:
    """`op_curves` as a plan made with `options` on `cluster` sees them (its devices and
    islands, uneven splits, recomputation, tensor parallelism)."""
    return op_curves(graph, profile, cluster.num_devices, uneven=options.uneven_splits,
                     recompute=options.recompute, tensor_parallel=options.tensor_parallel,
                     island_size=cluster.island_size, profile_name=profile_name)


def allocate(graph: MetaOpGraph, curves: dict[str, OpCurve], num_devices: int, *,
             spread: bool = False) -> list[LevelAllocation]:
    """The allocator's result for every MetaLevel, in level order (`spread`:
    `allocate_level`'s)."""
    return [
        allocate_level(lvl, [curves[m.id] for m in graph.metaops if m.level == lvl], num_devices,
                       spread=spread)
        for lvl in range(graph.num_levels)
        if any(m.level == lvl for m in graph.metaops)
    ]


def slice_limits(graph: MetaOpGraph, curves: dict[str, OpCurve], cluster: ClusterSpec,
                 memory: MemoryStrategy = NO_SAVING) -> MaxOps:
    """The most operators one slice of a MetaOp on n devices may run (memory.py), at most its
    operators: a limit no slice reaches reads the same under every memory setting, which lets
    `Schedules` reuse a schedule across them."""
    by_id = {m.id: m for m in graph.metaops}
    cache: dict[tuple[str, int], int] = {}

    def max_ops(metaop: str, n: int) -> int:
        if (metaop, n) not in cache:
            m = by_id[metaop]
            cache[(metaop, n)] = min(m.num_layers, max_ops_per_slice(
                m, n, scaling.strategy(curves[metaop].curve, n), graph.dtype,
                cluster.device.memory_bytes, memory))
        return cache[(metaop, n)]

    return max_ops


def capped_curves(curves: dict[str, OpCurve], cap: int) -> dict[str, OpCurve]:
    """Every curve restricted to counts <= cap (PlanInfeasible when a MetaOp has none)."""
    result = {}
    for mid, oc in curves.items():
        k = bisect_right(oc.counts, cap)
        if k <= 1:
            raise PlanInfeasible(f"MetaOp {mid} has no valid device count <= {cap}")
        result[mid] = replace(oc, counts=oc.counts[:k], speedups=oc.speedups[:k],
                              times_ms=oc.times_ms[:k])
    return result


class _Traced(NamedTuple):
    """A variant `level_waves` scheduled, its trace, and the trace's waves shortened."""

    variant: Variant
    trace: TracedWaves
    shortened: list[PlannedWave]
    shortened_ms: float


def level_waves(graph: MetaOpGraph, curves: dict[str, OpCurve], allocs: list[LevelAllocation],
                num_devices: int, max_ops: MaxOps | None = None, *,
                few_variants: bool = False, extend: bool = True) -> list[list[PlannedWave]]:
    """Algorithm 1 on every level, one schedule per level (`level_schedule`)."""
    return [level_schedule(graph, curves, a, num_devices, max_ops, few_variants=few_variants,
                           extend=extend) for a in allocs]


def level_schedule(graph: MetaOpGraph, curves: dict[str, OpCurve], a: LevelAllocation,
                   num_devices: int, max_ops: MaxOps | None = None, *,
                   few_variants: bool = False, extend: bool = True) -> list[PlannedWave]:
    """Algorithm 1 on one level, every MetaOp of the levels below finished. The level is
    scheduled with every variant (proposal order, alignment, extension rule; a few on very
    large levels, or everywhere with `few_variants`; without `extend`, idle devices stay
    idle: `waves.without_extension`) and the shortest schedule is kept (the first on ties):
    the variants are cheap and no single one wins on every level. A level's schedule depends
    only on its own allocation's tuples (`level_tuples`), so schedules of different
    allocations can be mixed."""
    preds = {m.id: m.predecessors for m in graph.metaops}
    finished = {m.id for m in graph.metaops if m.level < a.level}
    best: list[PlannedWave] | None = None
    best_ms = math.inf
    num_tuples = sum(len(x.tuples) for x in a.ops)
    # variants often build the same waves: a variant differing from a traced one only in
    # switches that made no difference there is not run again, and each distinct result is
    # shortened (and timed) once
    traced: list[_Traced] = []
    shortened: dict[tuple[PlannedWave, ...], tuple[list[PlannedWave], float]] = {}
    variants = VARIANTS if num_tuples <= LARGE_LEVEL and not few_variants else LARGE_LEVEL_VARIANTS
    for variant in variants if extend else without_extension(variants):
        covering = next((x for x in traced if x.trace.covers(variant, x.variant)), None)
        if covering is None:
            rule, rounding, extension = variant
            trace = traced_wavefront_level(a, curves, num_devices, preds, set(finished),
                                           sort_rule=rule, rounding=rounding,
                                           extension=extension, max_ops=max_ops)
            key = tuple(trace.waves)
            if key not in shortened:
                short = shorten_waves(trace.waves, max_ops)
                shortened[key] = (short, compute_ms(short))
            covering = _Traced(variant, trace, *shortened[key])
            traced.append(covering)
        trial, trial_ms = covering.shortened, covering.shortened_ms
        if best is None or trial_ms < best_ms - 1e-9:
            best, best_ms = trial, trial_ms
    assert best is not None
    return best


def level_tuples(a: LevelAllocation) -> tuple[tuple[AslTuple, ...], ...]:
    """What `level_schedule` reads of a level's allocation: its MetaOps' tuples, in order."""
    return tuple(o.tuples for o in a.ops)


def spindle_waves(graph: MetaOpGraph, curves: dict[str, OpCurve], allocs: list[LevelAllocation],
                  num_devices: int, max_ops: MaxOps | None = None, *,
                  few_variants: bool = False) -> list[PlannedWave]:
    """`level_waves`, concatenated."""
    return [w for level in level_waves(graph, curves, allocs, num_devices, max_ops,
                                       few_variants=few_variants) for w in level]


def fused_waves(graph: MetaOpGraph, curves: dict[str, OpCurve], allocs: list[LevelAllocation],
                num_devices: int, max_ops: MaxOps | None = None, *,
                extend: bool = True) -> list[PlannedWave]:
    """Beyond the paper: Algorithm 1 on all levels at once, with each level's tuples as the
    allocator made them. A MetaOp is proposed as soon as its predecessors have finished, so a
    task whose encoder ends early goes on to its next MetaOps while a longer encoder of
    another task still runs, instead of waiting at the level's barrier. The level-by-level
    schedule balances a level by giving its long MetaOps more devices; when a device bound
    (`search.device_caps`) stops that, the barrier idles the short MetaOps' devices, which fusing
    gives back (OFASys 4 tasks on 32 devices inside islands: 52.9 ms of compute instead of
    62.1). The variants of a large level are tried (planning time; without `extend`, with
    idle devices left idle). A wave's level is the lowest level among its slots."""
    preds = {m.id: m.predecessors for m in graph.metaops}
    fused = LevelAllocation(level=allocs[0].level,
                            c_star_ms=math.fsum(a.c_star_ms for a in allocs),
                            lower_bound_ms=math.fsum(a.lower_bound_ms for a in allocs),
                            ops=tuple(o for a in allocs for o in a.ops))
    level_of = {m.id: m.level for m in graph.metaops}
    best: list[PlannedWave] | None = None
    best_ms = math.inf
    for rule, rounding, extension in (LARGE_LEVEL_VARIANTS if extend
                                      else without_extension(LARGE_LEVEL_VARIANTS)):
        trial = schedule_level(fused, curves, num_devices, preds, set(), sort_rule=rule,
                               rounding=rounding, extension=extension, max_ops=max_ops)
        trial_ms = compute_ms(trial)
        if best is None or trial_ms < best_ms - 1e-9:
            best, best_ms = trial, trial_ms
    assert best is not None
    return [PlannedWave(level=min(level_of[s.metaop] for s in w.slots), slots=w.slots)
            for w in best]


SPLIT_SHARE = 0.1
"""The share of the compute from which a wave is long (`split_first_long_wave`), and of its
span that the short wave split off it takes."""


def split_first_long_wave(planned: list[PlannedWave]) -> list[PlannedWave] | None:
    """The waves with the first one that takes SPLIT_SHARE of the compute or more split in
    two: a short wave of each slot's first operators up to SPLIT_SHARE of its span, then the
    rest (None when that leaves either empty)."""
    total = compute_ms(planned)
    i = next((i for i, w in enumerate(planned) if w.duration_ms >= SPLIT_SHARE * total), None)
    if i is None:
        return None
    wave = planned[i]
    span = SPLIT_SHARE * wave.duration_ms
    first, rest = [], []
    for s in wave.slots:
        k = min(s.num_ops, int(span // s.op_time_ms)) if s.op_time_ms > 0 else s.num_ops
        if k:
            first.append(replace(s, num_ops=k))
        if s.num_ops > k:
            rest.append(replace(s, num_ops=s.num_ops - k))
    if not first or not rest:
        return None
    return [*planned[:i], PlannedWave(level=wave.level, slots=tuple(first)),
            PlannedWave(level=wave.level, slots=tuple(rest)), *planned[i + 1:]]


_T = TypeVar("_T")


class Schedules:
    """The curves, allocations and wave schedules `api.make_plan` makes for one graph,
    profile, cluster and set of curve options (uneven splits, recomputation, tensor
    parallelism), kept for the next `make_plan` with the same ones: the memory settings of
    `api.fitting_plan_with_cost` with the same recomputation flag differ only in the slice
    limits (`slice_limits`) and in what follows the schedules (placement, simulation). A
    schedule is made again only when a slice limit it asked for differs under the new
    setting, so each plan is the one `make_plan` makes alone."""

    def __init__(self, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                 options: PlanOptions, *, inputs: tuple[InputRef, ...] = ()) -> None:
        self.graph, self.profile, self.cluster = graph, profile, cluster
        self.flags = _curve_flags(options)
        # errors name the profile by the path the plan records for it
        profile_name = next((r.path for r in inputs if r.kind == "profile"), "the profile")
        self.curves = options_curves(graph, profile, cluster, options, profile_name=profile_name)
        self.allocs = allocate(graph, self.curves, cluster.num_devices)
        self._capped: dict[tuple[int, bool], tuple[dict[str, OpCurve], list[LevelAllocation]]] = {
            (cluster.num_devices, False): (self.curves, self.allocs)}
        self._made: dict[tuple[Any, ...], list[tuple[dict[tuple[str, int], int], Any]]] = {}

    def serves(self, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
               options: PlanOptions) -> bool:
        """Whether these are the schedules of `make_plan(graph, profile, cluster, options)`."""
        return (graph is self.graph and profile is self.profile and cluster is self.cluster
                and _curve_flags(options) == self.flags)

    def capped(self, cap: int, spread: bool = False,
               ) -> tuple[dict[str, OpCurve], list[LevelAllocation]]:
        """The curves and allocation under a device bound (`spread`: `allocate`'s;
        PlanInfeasible when some MetaOp has no valid count under it)."""
        if (cap, spread) not in self._capped:
            capped = (self.capped(cap)[0] if spread else capped_curves(self.curves, cap))
            self._capped[(cap, spread)] = (capped, allocate(
                self.graph, capped, self.cluster.num_devices, spread=spread))
        return self._capped[(cap, spread)]

    def made(self, key: tuple[Any, ...], max_ops: MaxOps | None, make: Callable[..., _T],
             *args: Any, **kwargs: Any) -> _T:
        """`make(*args, **kwargs)` with `max_ops` passed on as `max_ops` (without, when None: a
        `make` that takes no slice limits), or what it returned before under `key` when every
        slice limit it asked for then reads the same in `max_ops`. `key` names `make` and
        every argument besides the graph, cluster and these curves and allocations."""
        for asked, result in self._made.get(key, ()):
            if all(max_ops is not None and max_ops(m, n) == k for (m, n), k in asked.items()):
                return result
        asked: dict[tuple[str, int], int] = {}
        if max_ops is None:
            result = make(*args, **kwargs)
        else:
            limits = max_ops

            def recorded(metaop: str, n: int) -> int:
                if (metaop, n) not in asked:
                    asked[(metaop, n)] = limits(metaop, n)
                return asked[(metaop, n)]

            result = make(*args, max_ops=recorded, **kwargs)
        self._made.setdefault(key, []).append((asked, result))
        return result

    def levels(self, cap: int, allocs: list[LevelAllocation], max_ops: MaxOps, *,
               extend: bool = True) -> list[list[PlannedWave]]:
        """`level_waves` of `allocs` under the device bound `cap` (few variants below the
        whole cluster), each level made once per bound, extension rule and tuples (`made`):
        an allocation spread, or on one count per MetaOp, that leaves a level's tuples as
        they were reuses its schedule (multitask-clip 10 tasks on 64 GPUs: the encoders'
        level, ~60 ms, made once instead of twice)."""
        curves, n_dev = self.capped(cap)[0], self.cluster.num_devices
        return [self.made(("level", cap, extend, a.level, level_tuples(a)), max_ops,
                          level_schedule, self.graph, curves, a, n_dev,
                          few_variants=cap != n_dev, extend=extend) for a in allocs]


def _curve_flags(options: PlanOptions) -> tuple[bool, bool, bool]:
    """The options `options_curves` reads."""
    return options.uneven_splits, options.recompute, options.tensor_parallel
