"""All levels in one schedule (schedules.fused_waves) and Spindle's use of it as a candidate."""

from __future__ import annotations

from pathlib import Path

from plan_builders import alpha_beta_curve, cluster, graph, metaop, profile

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.planner import api, schedules
from spindle_cli.planner.assemble import assemble
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]


def uneven_encoders():
    """Task a has a long encoder and a short head, task b the reverse. On 2 nodes of 4 under
    the one-node bound, level 0 lasts as long as a's encoder and level 1 as long as b's head,
    unless b's head may start before a's encoder ends."""
    ms = [metaop("a/enc", layers=16), metaop("b/enc", layers=4),
          metaop("a/head", level=1, layers=4, preds=("a/enc",)),
          metaop("b/head", level=1, layers=16, preds=("b/enc",))]
    curves = [alpha_beta_curve(m.id, 8, 0.05, 1.0) for m in ms]
    return graph(ms), profile(curves), cluster(num_nodes=2, per_node=4)


def _capped(g, p, c, cap):
    curves = schedules.op_curves(g, p, c.num_devices)
    capped = schedules.capped_curves(curves, cap)
    return (capped, schedules.allocate(g, capped, c.num_devices),
            schedules.slice_limits(g, curves, c))


def test_fused_waves_start_a_metaop_once_its_predecessors_end():
    g, p, c = uneven_encoders()
    capped, allocs, max_ops = _capped(g, p, c, 4)
    fused = schedules.fused_waves(g, capped, allocs, c.num_devices, max_ops)
    levelled = schedules.spindle_waves(g, capped, allocs, c.num_devices, max_ops, few_variants=True)
    assert sum(w.duration_ms for w in fused) < sum(w.duration_ms for w in levelled) - 1e-9
    waves_of: dict[str, list[int]] = {}
    for i, w in enumerate(fused):
        assert sum(s.n for s in w.slots) <= c.num_devices
        assert all(s.n <= 4 for s in w.slots)
        assert w.level == min(g.metaop(s.metaop).level for s in w.slots)
        for s in w.slots:
            waves_of.setdefault(s.metaop, []).append(i)
    for m in g.metaops:
        assert sum(s.num_ops for w in fused for s in w.slots if s.metaop == m.id) == m.num_layers
        for pred in m.predecessors:
            assert max(waves_of[pred]) < min(waves_of[m.id])
    # b's head runs beside a's encoder: the level barrier is gone
    assert min(waves_of["b/head"]) <= max(waves_of["a/enc"])


def test_make_plan_keeps_the_fused_plan_when_it_simulates_faster():
    g, p, c = uneven_encoders()
    capped, allocs, max_ops = _capped(g, p, c, 4)
    fused = assemble(g, capped, c, PlanOptions(), (), allocs,
                     schedules.fused_waves(g, capped, allocs, c.num_devices, max_ops))
    kept = api.make_plan(g, p, c)
    kept_ms = simulate(kept, g, p, c).iteration_ms
    assert kept_ms <= simulate(fused, g, p, c).iteration_ms + 1e-9
    # the kept plan is valid: every MetaOp starts after its predecessors' last slice
    last_wave = {s.metaop: w.index for w, s in kept.slices()}
    for w, s in kept.slices():
        for pred in g.metaop(s.metaop).predecessors:
            assert last_wave[pred] < w.index


def test_spindle_is_not_slower_than_optimus_on_ofasys4_at_32():
    """Issue 5's losing cell: OFASys 4 tasks on four nodes, no memory saving. Level by level
    inside nodes, the image encoder's level kept the other tasks' nodes idle."""
    spec = load(str(ROOT / "models" / "ofasys.yaml"), ModelSpec)
    c = load(str(ROOT / "clusters" / "a800-4x8.yaml"), ClusterSpec)
    g = build_graph(spec, tasks=list(spec.task_sets["4"]))
    p = analytic_profile(g, c, hardware="a800", counts=[1, 2, 4, 8, 16, 32])
    ms = {planner: simulate(api.make_plan(g, p, c, options=PlanOptions(planner=planner)),
                            g, p, c).iteration_ms for planner in ("spindle", "optimus")}
    assert ms["spindle"] <= ms["optimus"]
