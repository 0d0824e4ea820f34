"""`spindle explain PLAN METAOP`: how the plan treats one MetaOp: its scaling curve, n*, the
two bi-point tuples (before and after rounding), the waves it ran in, and its level's gap to
C* and to the exact packing of the level's tuples (small levels).

The graph, profile and cluster are read from the paths recorded in the plan's `inputs` (as
written, then relative to the plan's directory and the ones above it) and must still hash to
the recorded sha256, and the plan is checked against them as `spindle simulate` checks it
(`load_plan_inputs`).
"""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING

import click
from rich.table import Table

from spindle_cli.artifacts import ClusterSpec, MetaOp, MetaOpGraph, Plan, Profile
from spindle_cli.cli._console import out
from spindle_cli.cli.common import load_input
from spindle_cli.cli.simulate import load_plan_inputs
from spindle_cli.cli.views import print_table, rank_text
from spindle_cli.cli.views.plan import mixed_waves
from spindle_cli.errors import SpindleError
from spindle_cli.planner.allocation import LevelAllocation, OpAllocation, OpCurve, op_time_ms

if TYPE_CHECKING:
    from spindle_cli.planner.options import PlanOptions


@click.command()
@click.argument("plan_path", metavar="PLAN")
@click.argument("metaop_id", metavar="METAOP")
def explain(plan_path: str, metaop_id: str) -> None:
    """Explain the allocation and the waves of one MetaOp of PLAN."""
    from spindle_cli.planner.options import PlanOptions
    from spindle_cli.planner.schedules import options_curves

    plan = load_input(plan_path, Plan)
    graph, profile, cluster, graph_path, profile_path = load_plan_inputs(plan, plan_path)
    _check_metaop(metaop_id, graph, plan_path, graph_path)
    m = graph.metaop(metaop_id)
    options = PlanOptions.of(plan)
    curves = options_curves(graph, profile, cluster, options, profile_name=profile_path)
    _print_curve(m, curves[m.id], profile)
    _print_counts_not_used(m, curves[m.id], plan, profile, cluster, options)
    level = _print_allocation(m, plan, graph, curves)
    _print_waves(m, plan)
    _print_level_time(m, plan, graph, curves, cluster, level)


def _check_metaop(metaop_id: str, graph: MetaOpGraph, plan_path: str, graph_path: str) -> None:
    """SpindleError unless `graph` has the MetaOp, with a hint of the ids it may mean."""
    ids = [m.id for m in graph.metaops]
    if metaop_id not in ids:
        # the same module in other tasks, else ids spelled alike ('' names no module)
        module = metaop_id.split("/")[-1]
        near = ([i for i in ids if module and module in i]
                or difflib.get_close_matches(metaop_id, ids, n=5, cutoff=0.6))[:5]
        hint = (f"did you mean {', '.join(near)}?" if near else
                f"a MetaOp is TASK/MODULE, such as {ids[0]}: `spindle show {graph_path}` lists "
                f"all {len(ids)}")
        raise SpindleError(f"{plan_path}: no MetaOp {metaop_id!r}", hint=hint)


def _print_curve(m: MetaOp, oc: OpCurve, profile: Profile) -> None:
    """The MetaOp's line, and its scaling curve at the valid device counts."""
    from spindle_cli.planner import scaling

    out.print(f"{m.id}: {m.num_layers} x {m.layer_kind} of module {m.module} (layers "
              f"[{m.first_layer}:{m.first_layer + m.num_layers})), batch {m.batch_size}, "
              f"level {m.level}; signature {m.signature}")
    table = Table(title="scaling curve at the valid device counts")
    for col in ("n", "strategy", "T(n) ms/op", "L*T(n) ms", "speedup", "from"):
        table.add_column(col, justify="right")
    lo, hi = min(profile.counts), max(profile.counts)
    for n, t, s in zip(oc.counts[1:], oc.times_ms[1:], oc.speedups[1:], strict=True):
        source = ("profiled" if n in profile.counts else
                  "fit, between profiled counts" if lo < n < hi else
                  "fit, beyond the profiled counts")
        table.add_row(str(n), scaling.strategy(oc.curve, n), f"{t:.4f}",
                      f"{m.num_layers * t:.3f}", f"{s:.2f}", source)
    print_table(table)


def _print_counts_not_used(m: MetaOp, oc: OpCurve, plan: Plan, profile: Profile,
                           cluster: ClusterSpec, options: PlanOptions) -> None:
    """Why the device counts the curve or the profile has but the allocation does not use are
    left out: not planned (tensor parallelism), not offered (no faster), not valid."""
    from spindle_cli.planner import scaling
    from spindle_cli.planner.schedules import planned_counts

    offered = planned_counts(oc.curve, plan.num_devices, uneven=options.uneven_splits,
                             tensor_parallel=options.tensor_parallel,
                             island_size=cluster.island_size)
    left_out = [n for n in scaling.valid_counts(oc.curve, plan.num_devices,
                                                uneven=options.uneven_splits)
                if n not in offered]
    if left_out:
        why = ("this plan leaves tensor parallelism out (--no-tensor-parallel)"
               if not options.tensor_parallel else
               f"a degree that does not divide the island size of {cluster.island_size}")
        out.print(f"not planned: {', '.join(map(str, left_out))} device(s), tensor parallel "
                  f"({', '.join(dict.fromkeys(scaling.strategy(oc.curve, n) for n in left_out))})"
                  f": {why}")
    slower = _no_faster(oc, offered, options.uneven_splits)
    if slower:
        out.print(f"not offered: {', '.join(map(str, sorted(slower)))} device(s), no faster "
                  f"than fewer devices ({_as_fast(slower)}): they would only hold more")
    missing = [n for n in profile.counts if n <= plan.num_devices and n not in oc.counts
               and n not in slower and n not in left_out]
    undivided = [n for n in missing if m.batch_size % n and not options.uneven_splits]
    if undivided:
        out.print(f"not valid: {', '.join(map(str, undivided))} device(s), which do not divide "
                  f"the batch of {m.batch_size} (a data-parallel slice splits it evenly; "
                  "--uneven-splits lets any count run)")
    if set(missing) - set(undivided):
        out.print(f"not valid: {', '.join(str(n) for n in missing if n not in undivided)} "
                  "device(s), where the profile has no point this MetaOp can use (out of "
                  "memory, a tensor-parallel degree that does not fit, or slower than fewer "
                  "devices)")


def _print_allocation(m: MetaOp, plan: Plan, graph: MetaOpGraph,
                      curves: dict[str, OpCurve]) -> LevelAllocation:
    """The MetaOp's n* against its level's C*, the allocation the plan was made from, and its
    bi-point tuples before and after rounding; returns its level's allocation."""
    from spindle_cli.planner.schedules import allocate

    # a plan kept from the allocation that spreads spare devices is explained by it
    spread = "spare devices spread" in plan.candidate
    [level] = [a for a in allocate(graph, curves, plan.num_devices, spread=spread)
               if a.level == m.level]
    a = next(x for x in level.ops if x.metaop == m.id)
    _print_n_star(m, curves[m.id], level, a)
    [other] = [x for lvl in allocate(graph, curves, plan.num_devices, spread=not spread)
               if lvl.level == m.level for x in lvl.ops if x.metaop == m.id]
    if not math.isclose(other.n_star, a.n_star, rel_tol=1e-9):
        _print_spread(a, other, spread)
    if a.n_lo == a.n_hi:
        lo = " (n* is a valid count: one tuple)"
    else:
        lo = ", dummy (n = 0)" if a.n_lo == 0 else f", ({a.n_lo}, {a.ops_lo:.2f})"
    out.print(f"tuples before rounding (n, ops): ({a.n_hi}, {a.ops_hi:.2f}){lo}")
    out.print("tuples after rounding: "
              + ", ".join(f"({t.n}, {t.num_ops})" for t in a.tuples))
    if plan.planner != "spindle":
        out.print(f"the plan is the {plan.planner} baseline's, which does not use the allocator: "
                  "the waves below, not these tuples, are what it runs")
    elif plan.candidate:
        out.print(f"the plan is Spindle's candidate '{plan.candidate}': the waves below, not "
                  "these tuples, are what it runs")
    return level


def _print_n_star(m: MetaOp, oc: OpCurve, level: LevelAllocation, a: OpAllocation) -> None:
    """The level's C* and the MetaOp's n*, between which valid counts it lies."""
    c_star = level.lower_bound_ms
    # the bi-point split takes the nearest counts on the concave envelope of the speedup
    # curve; a valid count between them (--uneven-splits) lies below it
    inside = [n for n in oc.counts if a.n_lo < n < a.n_hi]
    below = (f", the nearest on the concave envelope of its speedups ({', '.join(map(str, inside))}"
             f" lie{'s' * (len(inside) == 1)} below it: no faster than a mix of the two)"
             if inside else "")
    between = ("a valid count" if a.n_lo == a.n_hi else
               f"between valid counts {a.n_lo} and {a.n_hi}{below}" if a.n_lo else
               f"below the smallest valid count, {a.n_hi}: n_lo = 0, a dummy")
    if math.isclose(level.c_star_ms, c_star, rel_tol=1e-9):
        out.print(f"level {m.level}: C* = {c_star:.3f} ms; n* = {a.n_star:.3f} "
                  f"({between})")
    else:
        out.print(f"level {m.level}: C* = {c_star:.3f} ms (on the concave envelope of the "
                  "speedup curves, as plan, show and simulate count it); n* = "
                  f"{a.n_star:.3f} where every MetaOp ends at {level.c_star_ms:.3f} ms on the "
                  f"curves themselves ({between})")


def _print_spread(a: OpAllocation, other: OpAllocation, spread: bool) -> None:
    """Where allocating the fewest devices (`a` unless `spread`) and spreading the spare ones
    (`other` unless `spread`) give the MetaOp other n*: which the plan was made from."""
    from spindle_cli.planner.allocation import MIN_GAIN
    from spindle_cli.planner.search import NEAR_BEST

    fewest, spare = (other, a) if spread else (a, other)
    said = (f"the relaxed optimum (sum n* = N) gives it {spare.n_star:.3f} devices, the "
            f"level's spare ones with them; on {fewest.n_star:.0f} it already ends within "
            f"{MIN_GAIN:.1%} of C*")
    out.print(f"{said}: this plan was made from the relaxed optimum's allocation, spare "
              "devices spread (Spindle allocates the fewest first)" if spread else
              f"{said}, so Spindle allocates that (and the spread allocation where the "
              f"plan without it simulates within {NEAR_BEST:.0%} of the best, or does not "
              "fit)")


def _print_waves(m: MetaOp, plan: Plan) -> None:
    """The table of the plan's slices that run the MetaOp, wave by wave."""
    waves = Table(title="waves running it")
    for col in ("wave", "start ms", "wave ms", "ops", "ranks", "strategy", "slice ms"):
        waves.add_column(col, justify="right")
    for w, s in plan.slices():
        if s.metaop == m.id:
            waves.add_row(str(w.index), f"{w.start_ms:.3f}", f"{w.duration_ms:.3f}",
                          f"[{s.first}:{s.last})", rank_text(s.ranks), s.strategy,
                          f"{s.time_ms:.3f}")
    print_table(waves)


def _print_level_time(m: MetaOp, plan: Plan, graph: MetaOpGraph, curves: dict[str, OpCurve],
                      cluster: ClusterSpec, level: LevelAllocation) -> None:
    """The level's planned time against its C* and against the exact packing of its tuples
    (small levels), or why no planned time compares (waves that run several levels)."""
    from spindle_cli.planner.exact import TIME_LIMIT_S, exact_packing

    c_star = level.lower_bound_ms
    planned = next((lv.estimated_ms for lv in plan.levels if lv.level == m.level), 0.0)
    tuples = [(t.metaop, t.n, t.num_ops * curves[t.metaop].time_at(t.n))
              for x in level.ops for t in x.tuples]
    packing = exact_packing(tuples, cluster.num_devices, time_limit_s=TIME_LIMIT_S)
    mixed = mixed_waves(plan, graph)
    if mixed:
        line = (f"level {m.level}: {mixed} of the plan's {len(plan.waves)} waves run several "
                "levels at once (each counted under its lowest), so no planned time of this "
                "level compares with its C*")
    else:
        line = f"level {m.level} planned {planned:.3f} ms = {_times(planned, c_star)} C*"
    if packing is not None and packing.proven:
        best = packing.found_ms
        line += (f"; exact packing of the level's {len(tuples)} tuples {best:.3f} ms "
                 f"({_times(best, c_star)} C*")
        line += (")" if mixed else
                 f"; the waves take {_times(planned, best)} of it, below 1 where giving idle "
                 "devices to running MetaOps beats every packing of these fixed tuples)")
    elif packing is not None:
        line += (f"; the best packing of the level's {len(tuples)} tuples found in "
                 f"{TIME_LIMIT_S:g} s takes {packing.found_ms:.3f} ms "
                 f"({_times(packing.found_ms, c_star)} C*), none below {packing.bound_ms:.3f} "
                 "ms proven")
    out.print(line)


def _times(value: float, base: float) -> str:
    """'1.234x', or '-x' where the base rounds to no time at all."""
    return f"{value / base:.3f}x" if base > 0 else "-x"


def _no_faster(oc: OpCurve, counts: list[int], uneven: bool) -> dict[int, int]:
    """The counts of `counts` (those `op_curves` offered: `schedules.planned_counts`) that
    `allocation.op_curve` dropped because a smaller count runs as fast (with uneven splits,
    B = 64 runs 5 rows per device on 13 to 15), each with the largest such count."""
    kept = dict(zip(oc.counts[1:], oc.times_ms[1:], strict=True))
    slower = {}
    for n in counts:
        if n in kept:
            continue
        t = op_time_ms(oc.curve, n, uneven=uneven)
        if as_fast := [k for k, tk in kept.items() if k < n and tk <= t]:
            slower[n] = max(as_fast)
    return slower


def _as_fast(slower: dict[int, int]) -> str:
    """'9 as on 8; 14, 15 as on 13'."""
    groups: dict[int, list[int]] = {}
    for n, k in sorted(slower.items()):
        groups.setdefault(k, []).append(n)
    return "; ".join(f"{', '.join(map(str, ns))} as on {k}" for k, ns in groups.items())
