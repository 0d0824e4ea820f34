"""Plan assembly: planned waves placed on ranks (`placement.place`) and built into a Plan, with
its slices, activation transfers, parameter groups, memory table and level estimates in the
canonical order of docs/CONTRACTS.md (`assemble`); and a plan's waves placed anew
(`place_again`, the placement ablation).

What does not live here: which waves to assemble (`search.py`), the placement itself
(`placement.py`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.plan import LevelBound, ParamGroup, Plan, Slice, Transfer, Wave
from spindle_cli.artifacts.profile import Profile
from spindle_cli.planner import scaling
from spindle_cli.planner.alignment import PlannedWave, Slot, compute_ms
from spindle_cli.planner.allocation import LevelAllocation, OpCurve
from spindle_cli.planner.memory import Ledger, layer_params, state_bytes_per_param
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.placement import Flow, PlacedWaves, Ranks, SliceSpec, place
from spindle_cli.planner.schedules import allocate, options_curves


def assemble(graph: MetaOpGraph, curves: dict[str, OpCurve], cluster: ClusterSpec,
             options: PlanOptions, inputs: tuple[InputRef, ...],
             allocs: list[LevelAllocation], planned: list[PlannedWave],
             home: dict[str, Ranks] | None = None, *, reserve: bool = False,
             consecutive: bool = False, candidate: str = "",
             placements: PlacedWaves | None = None) -> Plan:
    """Place the planned waves (`home`: ranks each MetaOp prefers; `reserve`: ranks reserved
    for their rows; `consecutive`: on consecutive ranks whatever `options.placement` says;
    `placements`: leading waves earlier candidates placed; `placement.place`) and build the
    Plan (`candidate`: what it is, Plan.candidate); `allocs` give the levels' lower bounds."""
    n_dev = cluster.num_devices
    specs = _slice_specs(graph, curves, planned)
    flows = _flows(graph, specs)
    ranks, ledger = place(specs, flows, graph, cluster,
                          mode="sequential" if consecutive else options.placement,
                          memory=options.memory, home=home, reserve=reserve,
                          placements=placements)
    waves = _waves(planned, specs, ranks)
    transfers = tuple(_transfer(f, waves) for f in flows)
    levels = tuple(
        LevelBound(level=a.level, lower_bound_ms=a.lower_bound_ms,
                   estimated_ms=compute_ms(w for w in waves if w.level == a.level))
        for a in allocs
    )
    return Plan(
        **derived_header(Plan, list(inputs)),
        model=graph.model,
        cluster=cluster.name,
        planner=options.planner,
        options=options.as_dict(),
        candidate=candidate,
        num_devices=n_dev,
        islands=tuple(tuple(i) for i in cluster.islands()),
        waves=waves,
        transfers=transfers,
        param_groups=_param_groups(graph, ledger),
        memory=ledger.table(),
        levels=levels,
        lower_bound_ms=math.fsum(a.lower_bound_ms for a in allocs),
        estimated_iteration_ms=compute_ms(waves),
    )


def place_again(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                placement: str) -> Plan:
    """`plan`'s waves placed anew with `placement`: every slice keeps its MetaOp, operators
    and device count, only its ranks (and with them the transfers, parameter groups and
    memory) change. The placement ablation with the schedule held fixed, as the paper's
    Fig. 10 compares Spindle with and without its placement. A plan made with `placement`
    (without home, reserved or consecutive ranks) comes back unchanged, and one kept on
    consecutive ranks comes back unchanged from 'sequential'. PlanInfeasible when the waves do
    not fit on the devices that way."""
    options = replace(PlanOptions.of(plan), placement=placement)
    n_dev = cluster.num_devices
    curves = options_curves(graph, profile, cluster, options)
    planned = [PlannedWave(level=w.level, slots=tuple(
        Slot(metaop=s.metaop, n=len(s.ranks), num_ops=s.last - s.first,
             op_time_ms=curves[s.metaop].time_at(len(s.ranks))) for s in w.slices))
        for w in plan.waves]
    return assemble(graph, curves, cluster, options, plan.inputs,
                    allocate(graph, curves, n_dev), planned, candidate=plan.candidate)


def _sid(key: tuple[int, int]) -> str:
    return f"w{key[0]}.{key[1]}"


def _transfer(flow: Flow, waves: tuple[Wave, ...]) -> Transfer:
    """The flow between its placed slices."""
    src = waves[flow.src[0]].slices[flow.src[1]]
    dst = waves[flow.dst[0]].slices[flow.dst[1]]
    return Transfer(src=src.id, dst=dst.id, bytes=flow.bytes, src_ranks=src.ranks,
                    dst_ranks=dst.ranks)


def _slice_specs(graph: MetaOpGraph, curves: dict[str, OpCurve],
                 planned: list[PlannedWave]) -> list[list[SliceSpec]]:
    """Operator ranges in wave order: each MetaOp's slices take consecutive operators."""
    by_id = {m.id: m for m in graph.metaops}
    next_op: dict[str, int] = {}
    specs = []
    for w in planned:
        row = []
        for s in w.slots:
            m = by_id[s.metaop]
            first = next_op.get(m.id, 0)
            next_op[m.id] = first + s.num_ops
            row.append(SliceSpec(metaop=m, first=first, last=first + s.num_ops, n=s.n,
                                 strategy=scaling.strategy(curves[m.id].curve, s.n)))
        specs.append(row)
    for m in graph.metaops:
        assert next_op.get(m.id) == m.num_layers, f"{m.id}: scheduled {next_op.get(m.id)} ops"
    return specs


def _flows(graph: MetaOpGraph, specs: list[list[SliceSpec]]) -> list[Flow]:
    """Every activation flow, in the canonical order of docs/CONTRACTS.md: by consumer slice;
    for one consumer the flow from the MetaOp's previous slice, then one per predecessor in
    `MetaOp.predecessors` order (the order the consumer concatenates its inputs)."""
    by_id = {m.id: m for m in graph.metaops}
    first_slice: dict[str, tuple[int, int]] = {}
    last_slice: dict[str, tuple[int, int]] = {}
    prev_slice: dict[tuple[int, int], tuple[int, int]] = {}
    for wi, row in enumerate(specs):
        for si, s in enumerate(row):
            key = (wi, si)
            if s.metaop.id in last_slice:
                prev_slice[key] = last_slice[s.metaop.id]
            else:
                first_slice[s.metaop.id] = key
            last_slice[s.metaop.id] = key
    flows = []
    for wi, row in enumerate(specs):
        for si, s in enumerate(row):
            key = (wi, si)
            here = []
            if key in prev_slice:
                here.append(Flow(src=prev_slice[key], dst=key,
                                 bytes=s.metaop.activation_out_bytes))
            if first_slice[s.metaop.id] == key:
                for p in s.metaop.predecessors:
                    pm: MetaOp = by_id[p]
                    src = last_slice[p]
                    if src[0] >= wi:
                        raise AssertionError(f"{s.metaop.id} starts before predecessor {p} ends")
                    here.append(Flow(src=src, dst=key, bytes=pm.activation_out_bytes))
            flows.extend(here)
    return flows


def _waves(planned: list[PlannedWave], specs: list[list[SliceSpec]],
           ranks: list[list[Ranks]]) -> tuple[Wave, ...]:
    waves = []
    start = 0.0
    for wi, (pw, row) in enumerate(zip(planned, specs, strict=True)):
        slices = tuple(
            Slice(id=_sid((wi, si)), metaop=sp.metaop.id, first=sp.first, last=sp.last,
                  ranks=ranks[wi][si], strategy=sp.strategy, time_ms=slot.time_ms)
            for si, (slot, sp) in enumerate(zip(pw.slots, row, strict=True))
        )
        # a wave's level is its slices' lowest (what validate holds it to), whatever moves
        # between waves (shortening, splitting a long wave) left of the level it was made at
        waves.append(Wave(index=wi, level=min(sp.metaop.level for sp in row), start_ms=start,
                          duration_ms=pw.duration_ms, slices=slices))
        start += pw.duration_ms
    return tuple(waves)


def _param_groups(graph: MetaOpGraph, ledger: Ledger) -> tuple[ParamGroup, ...]:
    """Maximal layer ranges of each module with the same replica-holding ranks (every rank of
    every slice running the layer, as the placement's ledger holds them)."""
    params = layer_params(graph)
    grad_b = state_bytes_per_param(graph.dtype)[1]
    return tuple(
        ParamGroup(module=module, first_layer=first, last_layer=last, ranks=ranks,
                   bytes=(last - first) * params[module] * grad_b)
        for module, first, last, ranks in ledger.holder_ranges()
    )
