"""`spindle show PLAN`: the waves, per-rank memory and the gap to the relaxed optimum C*."""

from __future__ import annotations

from rich.table import Table

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, Profile, load_recorded_input
from spindle_cli.artifacts.plan import Plan
from spindle_cli.cli._console import err, out, wrote
from spindle_cli.cli.common import note_stale_graph
from spindle_cli.cli.views import print_table, rank_text
from spindle_cli.errors import InputNotFound, SpindleError
from spindle_cli.units import fmt_bytes


def _recorded_graph(plan: Plan, path: str) -> tuple[MetaOpGraph | None, str]:
    """The plan's graph, or None and why not. A recorded input found changed since (or
    invalid), the graph, profile or cluster, gets a note on stderr, and so does a graph whose
    own model changed since (`note_stale_graph`): the plan shown is then not what its inputs
    make, which validate, simulate and run refuse or note."""
    graph, why = None, "not found"
    for cls in (MetaOpGraph, Profile, ClusterSpec):
        try:
            found_path, found = load_recorded_input(plan, path, cls)
        except InputNotFound:
            continue
        except SpindleError as e:  # changed since, or invalid; or not recorded at all
            err.print(f"note: {e}", soft_wrap=True)
            why = "see the note above" if cls is MetaOpGraph else why
            continue
        if isinstance(found, MetaOpGraph):
            graph = found
            note_stale_graph(graph, found_path)
    return graph, why

def gap(plan: Plan) -> float:
    """Estimated iteration / sum of the levels' C* (1.0 for an empty bound)."""
    return plan.estimated_iteration_ms / plan.lower_bound_ms if plan.lower_bound_ms else 1.0


def wave_table(plan: Plan) -> Table:
    """One row per slice, grouped by wave."""
    table = Table(title="waves")
    for col in ("wave", "level", "start ms", "ms", "MetaOp", "ops", "ranks", "strategy",
                "slice ms"):
        table.add_column(col, justify="right" if col not in ("MetaOp", "ranks", "strategy")
                         else "left")
    for w in plan.waves:
        for i, s in enumerate(w.slices):
            head = i == 0
            table.add_row(str(w.index) if head else "", str(w.level) if head else "",
                          f"{w.start_ms:.2f}" if head else "",
                          f"{w.duration_ms:.2f}" if head else "", s.metaop,
                          f"[{s.first}:{s.last})", rank_text(s.ranks), s.strategy,
                          f"{s.time_ms:.2f}")
        table.add_section()
    return table


def memory_table(plan: Plan) -> Table:
    """Per-rank memory by category, one row per run of consecutive ranks that read the same
    (a data-parallel slice's ranks hold alike: 4096 ranks are a few rows, not 4096)."""
    table = Table(title="memory per rank")
    for col in ("rank", "params", "grads", "optimizer", "activations", "total"):
        table.add_column(col, justify="right")
    # plan.memory holds one entry per rank in rank order (Plan validates it)
    runs: list[tuple[list[int], tuple[str, ...]]] = []
    for m in plan.memory:
        row = tuple(fmt_bytes(b) for b in (m.param_bytes, m.grad_bytes, m.optimizer_bytes,
                                           m.activation_bytes, m.total_bytes))
        if runs and runs[-1][1] == row:
            runs[-1][0].append(m.rank)
        else:
            runs.append(([m.rank], row))
    for ranks, row in runs:
        table.add_row(rank_text(tuple(ranks)), *row)
    return table


def mixed_waves(plan: Plan, graph: MetaOpGraph) -> int:
    """Waves that hold a slice of a MetaOp of another level than the wave's. A fused or
    task-concurrent schedule runs several levels at once and labels each wave with its
    lowest, so its per-level planned times say nothing about a level: only their total
    compares with C*."""
    level_of = {m.id: m.level for m in graph.metaops}
    return sum(1 for w in plan.waves if any(level_of.get(s.metaop, w.level) != w.level
                                            for s in w.slices))


def level_table(plan: Plan, mixed: int | None = 0) -> Table:
    """C* and the planned time of every MetaLevel (no per-level gap when `mixed` waves
    hold several levels, `mixed_waves`, or when that is not known: None)."""
    table = Table(title="levels: planned vs C*")
    for col in ("level", "C* ms", "planned ms", "gap"):
        table.add_column(col, justify="right")
    for lv in plan.levels:
        ratio = lv.estimated_ms / lv.lower_bound_ms if lv.lower_bound_ms else 1.0
        table.add_row(str(lv.level), f"{lv.lower_bound_ms:.3f}", f"{lv.estimated_ms:.3f}",
                      f"{ratio:.3f}x" if mixed == 0 else "-")
    return table


def show(obj: Plan, path: str, *, gantt: str | None = None, utilization: str | None = None,
         text_gantt: bool = False) -> None:
    """Print the plan's summary, wave table, level gaps and memory; optionally charts (the
    image files first: a reader closing the pipe ends the command at its next line)."""
    if gantt or utilization:
        from spindle_cli.cli.views import gantt as charts

        if gantt:
            charts.write_gantt(obj, gantt)
            wrote(gantt)
        if utilization:
            charts.write_utilization(obj, utilization)
            wrote(utilization)
    moved = sum(t.bytes for t in obj.transfers if t.src_ranks != t.dst_ranks)
    out.print(f"plan of {obj.model} on {obj.cluster} ({path}): planner {obj.planner}, "
              f"options {', '.join(f'{k}={v}' for k, v in obj.options.items())}")
    if obj.candidate:
        out.print(f"kept candidate: {obj.candidate}")
    out.print(f"{obj.num_devices} ranks in {len(obj.islands)} island(s), {len(obj.waves)} waves, "
              f"{len(obj.transfers)} transfers ({fmt_bytes(moved)} of activations in those "
              f"between different rank sets), "
              f"{len(obj.param_groups)} parameter groups")
    out.print(f"estimated compute {obj.estimated_iteration_ms:.2f} ms (the waves' durations; "
              f"`spindle simulate` adds transfers and sync); relaxed optimum C* "
              f"{obj.lower_bound_ms:.2f} ms; gap {gap(obj):.3f}x")
    print_table(wave_table(obj))
    graph, why = _recorded_graph(obj, path)
    # without its graph, a plan's levels cannot be told apart
    mixed = None if graph is None else mixed_waves(obj, graph)
    print_table(level_table(obj, mixed))
    if mixed:
        out.print(f"{mixed} of {len(obj.waves)} waves run several levels at once, each counted "
                  "under its lowest level: only the total compares with C*")
    elif mixed is None:
        out.print(f"no per-level gap: without the plan's graph ({why}) its waves' levels "
                  "cannot be told apart; only the total compares with C*")
    print_table(memory_table(obj))
    peak = max(obj.memory, key=lambda m: (m.total_bytes, -m.rank))
    out.print(f"peak memory: rank {peak.rank}, {fmt_bytes(peak.total_bytes)}")
    if text_gantt:
        from spindle_cli.cli.views import gantt as charts

        out.print(charts.text_gantt(obj))
