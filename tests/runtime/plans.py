"""Hand-built plans for runtime tests (independent of the planner).

`hand_plan(graph, placement, num_devices)` takes, for every MetaOp, its slices as
(first, last, ranks) and schedules them into waves greedily (a slice goes to the first wave
after its inputs whose ranks are free), then derives transfers in canonical order and the
parameter groups, following docs/CONTRACTS.md.
"""

from __future__ import annotations

from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.io import derived_header, input_ref
from spindle_cli.artifacts.plan import (
    LevelBound,
    ParamGroup,
    Plan,
    RankMemory,
    Slice,
    Transfer,
    Wave,
)

Placement = dict[str, list[tuple[int, int, tuple[int, ...]]]]


def whole(graph: MetaOpGraph, ranks: tuple[int, ...]) -> Placement:
    """Every MetaOp in one slice on `ranks`."""
    return {m.id: [(0, m.num_layers, ranks)] for m in graph.metaops}


def hand_plan(graph: MetaOpGraph, placement: Placement, num_devices: int,
              graph_path: str = "graph.yaml", strategy: str = "dp") -> Plan:
    waves: list[list[tuple[str, int, int, tuple[int, ...]]]] = []
    wave_of: dict[tuple[str, int], int] = {}
    for m in graph.metaops:
        prev_wave = max((wave_of[(p, graph.metaop(p).num_layers)] for p in m.predecessors),
                        default=-1)
        for first, last, ranks in placement[m.id]:
            w = prev_wave + 1
            while w < len(waves) and any(set(ranks) & set(s[3]) for s in waves[w]):
                w += 1
            if w == len(waves):
                waves.append([])
            waves[w].append((m.id, first, last, ranks))
            wave_of[(m.id, last)] = w
            prev_wave = w
    ids: dict[tuple[str, int], str] = {}
    wave_objs = []
    for wi, items in enumerate(waves):
        slices = []
        for si, (mid, first, last, ranks) in enumerate(items):
            sid = f"w{wi}.{si}"
            ids[(mid, first)] = sid
            ids[(mid, -last)] = sid
            slices.append(Slice(id=sid, metaop=mid, first=first, last=last, ranks=ranks,
                                strategy=strategy, time_ms=1.0))
        wave_objs.append(Wave(index=wi, level=0, start_ms=float(wi), duration_ms=1.0,
                              slices=tuple(slices)))
    by_id = {s.id: s for w in wave_objs for s in w.slices}
    transfers = []
    for w in wave_objs:
        for s in w.slices:
            m = graph.metaop(s.metaop)
            srcs = ([ids[(m.id, -s.first)]] if s.first > 0 else
                    [ids[(p, -graph.metaop(p).num_layers)] for p in m.predecessors])
            for src in srcs:
                sm = graph.metaop(by_id[src].metaop)
                transfers.append(Transfer(src=src, dst=s.id, bytes=sm.activation_out_bytes,
                                          src_ranks=by_id[src].ranks, dst_ranks=s.ranks))
    holders: dict[tuple[str, int], set[int]] = {}
    for s in by_id.values():
        m = graph.metaop(s.metaop)
        for layer in range(m.first_layer + s.first, m.first_layer + s.last):
            holders.setdefault((m.module, layer), set()).update(s.ranks)
    groups: list[ParamGroup] = []
    for (module, layer), ranks in sorted(holders.items()):
        r = tuple(sorted(ranks))
        if groups and groups[-1].module == module and groups[-1].last_layer == layer \
                and groups[-1].ranks == r:
            g = groups.pop()
            groups.append(ParamGroup(module=module, first_layer=g.first_layer,
                                     last_layer=layer + 1, ranks=r, bytes=0))
        else:
            groups.append(ParamGroup(module=module, first_layer=layer, last_layer=layer + 1,
                                     ranks=r, bytes=0))
    return Plan(
        **derived_header(Plan, [input_ref(graph, graph_path)]),
        model=graph.model, cluster="hand", planner="spindle", num_devices=num_devices,
        islands=(tuple(range(num_devices)),), waves=tuple(wave_objs),
        transfers=tuple(transfers), param_groups=tuple(groups),
        memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                activation_bytes=0) for r in range(num_devices)),
        levels=(LevelBound(level=0, lower_bound_ms=0.0, estimated_ms=0.0),),
        lower_bound_ms=0.0, estimated_iteration_ms=float(len(wave_objs)),
    )
