"""Whether a plan schedules its graph the way the executor and the simulator assume
(docs/CONTRACTS.md, "Plan semantics"). The planner's own plans always do; a plan edited by
hand, or merged from two versions, may not, and then both would run something else than the
plan says."""

from __future__ import annotations

import math
from collections.abc import Mapping

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.plan import MEMORY_CATEGORIES, Plan, Slice, Transfer
from spindle_cli.artifacts.profile import Profile
from spindle_cli.errors import PlanError
from spindle_cli.planner.alignment import compute_ms
from spindle_cli.planner.allocation import OpCurve
from spindle_cli.planner.memory import (
    MemoryStrategy,
    layer_params,
    replayed_table,
    state_bytes_per_param,
)

EDITED = "edited since spindle plan wrote it?"
"""What a number a plan records that is not the one it implies suggests (`_same`)."""
EDITED_OR_VERSION = ("edited since spindle plan wrote it, or written by another version of "
                     "spindle, which read the profile otherwise? `spindle plan --check` tells")
"""The same for a slice's time, which a change to how the planner reads a profile's curves
moves too (`check_slice_times`)."""


def check_plan(plan: Plan, graph: MetaOpGraph) -> dict[tuple[str, int], tuple[int, ...]]:
    """PlanError unless: the plan is for the graph's model; every slice runs operators of a
    MetaOp of `graph` within its count; every operator of every MetaOp is in exactly one
    slice; a slice gets its inputs through exactly one transfer from each producer MetaOp (its
    own MetaOp's earlier slice when it does not start at operator 0), from an earlier wave,
    between the two slices' ranks, from the slice that ends where it needs (the producer's
    last operator, or its own MetaOp's operator before its first); and every layer a slice
    runs is in exactly one parameter group, whose ranks are all the ranks that run it. Returns
    those holders: (module, layer) -> sorted ranks."""
    if plan.model != graph.model:
        raise PlanError(f"model: the plan is for model {plan.model!r}, its graph for "
                        f"{graph.model!r}")
    ops = {m.id: m for m in graph.metaops}
    for w in plan.waves:
        for j, s in enumerate(w.slices):
            if s.metaop not in ops:
                raise PlanError(f"waves[{w.index}].slices[{j}].metaop: unknown MetaOp "
                                f"{s.metaop!r}")
    by_id, feeding = check_transfers(plan)
    _check_canonical_order(plan, ops, by_id)
    covered: dict[str, list[tuple[int, int]]] = {}
    holders: dict[tuple[str, int], set[int]] = {}
    for sid, (w, j, s) in by_id.items():
        m = ops[s.metaop]
        at = f"waves[{w}].slices[{j}] ({sid})"
        if s.last > m.num_layers:
            raise PlanError(f"{at}: operators [{s.first}, {s.last}) exceed the "
                            f"{m.num_layers} of {m.id}")
        covered.setdefault(m.id, []).append((s.first, s.last))
        wanted = {m.id} if s.first > 0 else set(m.predecessors)
        got = feeding.get(sid, set())
        if got != wanted:
            raise PlanError(f"{at}: needs inputs from {sorted(wanted)}, the plan's transfers "
                            f"bring {sorted(got)}")
        for layer in range(m.first_layer + s.first, m.first_layer + s.last):
            holders.setdefault((m.module, layer), set()).update(s.ranks)
    for mid, ranges in covered.items():
        ranges.sort()
        expect = 0
        for a, b in ranges:
            if a != expect:
                raise PlanError(f"waves: MetaOp {mid}: operators from {expect} are not "
                                "covered exactly once by its slices")
            expect = b
        if expect != ops[mid].num_layers:
            raise PlanError(f"waves: MetaOp {mid}: operators from {expect} are in no slice")
    missing = sorted(set(ops) - set(covered))
    if missing:
        raise PlanError(f"waves: MetaOp {missing[0]} has no slice in the plan")
    for ti, t in enumerate(plan.transfers):
        src, dst = by_id[t.src][2], by_id[t.dst][2]
        # a slice continues from the slice of its MetaOp that ends where it starts, and a
        # MetaOp's first slices take a producer's output from its last slice
        end = dst.first if src.metaop == dst.metaop else ops[src.metaop].num_layers
        if src.last != end:
            raise PlanError(f"transfers[{ti}]: {t.dst} needs the output of {src.metaop}'s "
                            f"operator {end - 1}, and {t.src} runs its operators "
                            f"[{src.first}, {src.last})")
    frozen = {k: tuple(sorted(v)) for k, v in sorted(holders.items())}
    _check_param_groups(plan, frozen)
    return frozen


def check_transfers(plan: Plan) -> tuple[dict[str, tuple[int, int, Slice]],
                                          dict[str, set[str]]]:
    """PlanError unless the slices are numbered by wave and position and each transfer runs
    from an earlier wave, between its two slices' ranks, at most one per producer MetaOp into
    a slice: what a plan says of itself, checked without its graph (validate of a plan whose
    graph is not found said ok to one whose transfers' ranks were not its slices'). Returns
    the slices by id, (wave, position, slice), and per slice the MetaOps its transfers bring."""
    by_id: dict[str, tuple[int, int, Slice]] = {}
    for w in plan.waves:
        for j, s in enumerate(w.slices):
            if s.id != f"w{w.index}.{j}":
                raise PlanError(f"waves[{w.index}].slices[{j}]: id {s.id!r} is not "
                                f"'w{w.index}.{j}' (slices are numbered by wave and position)")
            by_id[s.id] = (w.index, j, s)
    feeding: dict[str, set[str]] = {}
    for ti, t in enumerate(plan.transfers):
        (src_wave, _, src), (dst_wave, _, dst) = by_id[t.src], by_id[t.dst]
        if src.metaop in feeding.setdefault(t.dst, set()):
            raise PlanError(f"transfers[{ti}]: two transfers from {src.metaop!r} into slice "
                            f"{t.dst}")
        if src_wave >= dst_wave:
            raise PlanError(f"transfers[{ti}]: {t.src} is not in an earlier wave than {t.dst}")
        if t.src_ranks != src.ranks or t.dst_ranks != dst.ranks:
            raise PlanError(f"transfers[{ti}]: {t.src} -> {t.dst}: ranks differ from its "
                            "slices'")
        feeding[t.dst].add(src.metaop)
    return by_id, feeding


def check_profile(graph: MetaOpGraph, profile: Profile, profile_path: str) -> None:
    """PlanError ('<profile_path>: ...') naming the first MetaOp of `graph` that `profile` has
    no curve for (a plan's recorded profile made for another graph), or whose curve is for
    another batch than the MetaOp runs (T(n) = alpha + beta * B / n reads B from the curve: an
    edited batch_size)."""
    have = {c.signature: c for c in profile.curves}
    missing = [m for m in graph.metaops if m.signature not in have]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanError(f"{profile_path}: no curve for MetaOp {missing[0].id} (signature "
                        f"{missing[0].signature!r}){more}: not a profile of graph "
                        f"{graph.model!r}", hint="profile the plan's graph (spindle profile)")
    for m in graph.metaops:
        curve = have[m.signature]
        if curve.batch_size != m.batch_size:
            raise PlanError(f"{profile_path}: curve {m.signature!r}: batch_size "
                            f"{curve.batch_size}, but MetaOp {m.id} runs a batch of "
                            f"{m.batch_size}",
                            hint="profile the graph again (spindle profile)")


def check_recorded(plan: Plan, graph: MetaOpGraph, memory: MemoryStrategy) -> None:
    """PlanError unless the numbers a plan records beside its slices are the ones they imply:
    each wave's level is its slices' lowest MetaLevel, it starts where the one before ends
    and lasts as long as its longest slice, the estimates are the sums of the waves'
    durations (per level and in all), the lower bound the sum of the levels', and the memory
    per rank what the slices hold under `memory`, the plan's strategy (`memory.Ledger`, as
    placement computed it; the executor refuses a rank by it), each transfer's bytes its
    producer's output and each parameter group's its layers' gradients (what the simulator
    moves). For plans read from files (validate, run), after `check_plan`; plans built in
    memory may leave them out."""
    start = 0.0
    for w in plan.waves:
        lowest = min((graph.metaop(s.metaop).level for s in w.slices), default=w.level)
        if w.level != lowest:
            raise PlanError(f"waves[{w.index}].level: recorded {w.level}, but its slices' "
                            f"lowest MetaLevel is {lowest} ({EDITED})")
        _same(f"waves[{w.index}].start_ms", w.start_ms, start)
        _same(f"waves[{w.index}].duration_ms", w.duration_ms,
              max((s.time_ms for s in w.slices), default=0.0))
        start += w.duration_ms
    _same("estimated_iteration_ms", plan.estimated_iteration_ms, start)
    _same("lower_bound_ms", plan.lower_bound_ms, math.fsum(lv.lower_bound_ms for lv in plan.levels))
    for i, lv in enumerate(plan.levels):
        _same(f"levels[{i}].estimated_ms", lv.estimated_ms,
              compute_ms(w for w in plan.waves if w.level == lv.level))
    metaop_of = {s.id: s.metaop for _, s in plan.slices()}
    for i, t in enumerate(plan.transfers):
        sent = graph.metaop(metaop_of[t.src]).activation_out_bytes
        if t.bytes != sent:
            raise PlanError(f"transfers[{i}].bytes: recorded {t.bytes}, but {t.src} sends "
                            f"{sent} ({EDITED})")
    per_layer = layer_params(graph)
    grad_b = state_bytes_per_param(graph.dtype)[1]
    for i, g in enumerate(plan.param_groups):
        held = (g.last_layer - g.first_layer) * per_layer.get(g.module, 0) * grad_b
        if g.bytes != held:
            raise PlanError(f"param_groups[{i}].bytes: recorded {g.bytes}, but its layers' "
                            f"gradients take {held} ({EDITED})")
    for recorded, implied in zip(plan.memory, replayed_table(plan, graph, memory), strict=True):
        for name in MEMORY_CATEGORIES:
            if getattr(recorded, name) != getattr(implied, name):
                raise PlanError(f"memory[{recorded.rank}].{name}: recorded "
                                f"{getattr(recorded, name)}, but its slices need "
                                f"{getattr(implied, name)} ({EDITED})")


def check_slice_times(plan: Plan, curves: Mapping[str, OpCurve]) -> None:
    """PlanError unless each slice's time is its operators' on its ranks by `curves` (the
    planner's: `schedules.options_curves` of the plan's graph, profile, cluster and options), as
    spindle plan recorded it; `check_recorded` holds the waves to their longest slice."""
    for w in plan.waves:
        for si, s in enumerate(w.slices):
            curve, n = curves[s.metaop], len(s.ranks)
            where = f"waves[{w.index}].slices[{si}]"
            if n not in curve.counts[1:]:
                raise PlanError(f"{where}.ranks: {n} ranks, which MetaOp {s.metaop}'s curve "
                                f"gives no time for ({EDITED_OR_VERSION})")
            _same(f"{where}.time_ms", s.time_ms, (s.last - s.first) * curve.time_at(n),
                  EDITED_OR_VERSION)


def _check_canonical_order(plan: Plan, ops: dict[str, MetaOp],
                           by_id: dict[str, tuple[int, int, Slice]]) -> None:
    """PlanError unless the transfers are in canonical order (by destination wave and slice,
    its own MetaOp's earlier slice first, then its predecessors in order) and the parameter
    groups by module and first layer: as `spindle plan` writes them, so that a diff of two
    plans shows what changed, not where it was listed."""

    def key(t: Transfer) -> tuple[int, int, int]:
        (_, _, src), (wave, position, dst) = by_id[t.src], by_id[t.dst]
        preds = ops[dst.metaop].predecessors
        source = 0 if src.metaop == dst.metaop else (
            1 + preds.index(src.metaop) if src.metaop in preds else len(preds) + 1)
        return wave, position, source

    keys = [key(t) for t in plan.transfers]
    for ti in range(1, len(keys)):
        if keys[ti] < keys[ti - 1]:
            raise PlanError(f"transfers[{ti}]: {plan.transfers[ti].src} -> "
                            f"{plan.transfers[ti].dst} is out of canonical order (by destination "
                            "wave and slice, then source: its own MetaOp first, then its "
                            "predecessors in order)")
    groups = [(g.module, g.first_layer) for g in plan.param_groups]
    for gi in range(1, len(groups)):
        if groups[gi] < groups[gi - 1]:
            raise PlanError(f"param_groups[{gi}]: {groups[gi][0]}[{groups[gi][1]}:] is out of "
                            "order (by module, then first layer)")


def _check_param_groups(plan: Plan, holders: dict[tuple[str, int], tuple[int, ...]]) -> None:
    """Every layer a slice runs must be in exactly one ParamGroup whose ranks are exactly its
    holders, and a group only layers some slice runs: the gradient sync relies on it (a group
    of a module no slice runs, or of layers past its end, synced nothing the simulator and
    the run's prediction counted)."""
    seen: dict[tuple[str, int], int] = {}
    for i, g in enumerate(plan.param_groups):
        for layer in range(g.first_layer, g.last_layer):
            key = (g.module, layer)
            if key in seen:
                raise PlanError(f"param_groups[{i}]: layer {layer} of {g.module!r} is in two "
                                "groups")
            if key not in holders:
                raise PlanError(f"param_groups[{i}]: no slice runs layer {layer} of module "
                                f"{g.module!r}")
            seen[key] = i
    for (module, layer), ranks in holders.items():
        if (module, layer) not in seen:
            raise PlanError(f"param_groups: no group holds layer {layer} of module {module!r} "
                            f"(held by ranks {list(ranks)})")
        i = seen[(module, layer)]
        if plan.param_groups[i].ranks != ranks:
            raise PlanError(f"param_groups[{i}].ranks: {list(plan.param_groups[i].ranks)}, but "
                            f"layer {layer} of module {module!r} is held by ranks {list(ranks)}")


def check_cluster(plan: Plan, cluster: ClusterSpec, *, name: bool = True) -> None:
    """PlanError unless the plan is for as many devices as its cluster has, in its NVLink
    islands (the plan keeps every tensor-parallel group inside one of its own islands), and
    (with `name`) named as it is."""
    if cluster.num_devices != plan.num_devices:
        raise PlanError(f"the plan is for {plan.num_devices} devices but its cluster has "
                        f"{cluster.num_devices}")
    if [list(i) for i in plan.islands] != cluster.islands():
        raise PlanError(f"islands: the plan's NVLink islands are not its cluster's (islands of "
                        f"{cluster.island_size} consecutive ranks; edited since spindle plan "
                        "wrote it?)")
    if name and plan.cluster != cluster.name:
        raise PlanError(f"cluster: the plan is for cluster {plan.cluster!r}, its cluster file "
                        f"is {cluster.name!r}")


def _same(field: str, recorded: float, implied: float, why: str = EDITED) -> None:
    """PlanError unless `recorded` is `implied`, up to the digits a file keeps."""
    if not math.isclose(recorded, implied, rel_tol=1e-6, abs_tol=1e-6):
        raise PlanError(f"{field}: recorded {recorded:g}, but the plan implies {implied:g} "
                        f"({why})")
