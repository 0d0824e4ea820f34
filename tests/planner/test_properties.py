"""Property tests over random multi-task graphs and curves: every planner's plan schedules
every operator exactly once, respects dependencies, never uses a rank twice in a wave, uses
valid counts, and keeps memory within capacity, or fails with PlanInfeasible."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples
from plan_builders import alpha_beta_curve, cluster, curve, graph, metaop, profile
from test_api import check_contract

from spindle_cli.artifacts.plan import tp_group_size
from spindle_cli.artifacts.profile import tp_degree
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner import scaling
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.options import PlanOptions


@st.composite
def problems(draw):
    num_tasks = draw(st.integers(1, 4))
    metaops, curves = [], []
    for t in range(num_tasks):
        batch = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
        width = draw(st.integers(1, 3))
        encoders = []
        for e in range(width):
            mid = f"t{t}/enc{e}"
            # tasks share encoder modules by index, so parameters are shared across tasks
            metaops.append(metaop(mid, layers=draw(st.integers(1, 6)), batch=batch,
                                  module=f"enc{e}", params=draw(st.integers(0, 5000)),
                                  stash=draw(st.integers(0, 500))))
            encoders.append(mid)
        depth = draw(st.integers(0, 2))
        prev = tuple(encoders)
        for d in range(depth):
            mid = f"t{t}/head{d}"
            metaops.append(metaop(mid, level=d + 1, layers=draw(st.integers(1, 4)), batch=batch,
                                  preds=prev, module=f"head{d}", params=draw(st.integers(0, 500))))
            prev = (mid,)
    for m in metaops:
        alpha, beta = draw(st.floats(0.0, 2.0)), draw(st.floats(0.01, 5.0))
        if draw(st.booleans()):
            curves.append(alpha_beta_curve(m.id, m.batch_size, alpha, beta))
        else:  # tensor parallel above 2 devices: counts must be even
            curves.append(curve(m.id, m.batch_size, [(1, 2, alpha, beta, "dp"),
                                                     (2, 64, alpha * 1.1, beta * 0.9, "tp2")]))
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.sampled_from([1, 2, 4]))
    memory = draw(st.sampled_from([10**5, 10**6, 10**9]))
    return graph(metaops), profile(curves), cluster(num_nodes=nodes, per_node=per_node,
                                                   memory_bytes=memory)


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["spindle", "sequential", "optimus", "distmm"]),
       st.sampled_from(["island", "sequential"]), st.booleans())
def test_plans_are_valid_or_infeasible(problem, planner, placement, uneven):
    g, p, c = problem
    options = PlanOptions(planner=planner, placement=placement, uneven_splits=uneven)
    try:
        plan = make_plan(g, p, c, options=options)
    except PlanInfeasible as e:
        # out of memory names the rank and the bytes; consecutive ranks may also split a
        # tensor-parallel group over two islands, which the profile's times do not allow
        assert ("rank" in str(e) and "bytes" in str(e)) or (
            placement == "sequential" and "across two islands" in str(e)), str(e)
        return
    check_contract(plan, g)
    for _, s in plan.slices():
        curve = p.curve(g.metaop(s.metaop).signature)
        assert scaling.is_valid(curve, len(s.ranks), uneven=uneven)
        assert len(s.ranks) <= c.num_devices
    for m in plan.memory:
        assert m.total_bytes <= c.device.memory_bytes
    # each rank's weights (2 B per parameter, no ZeRO) are every layer it runs, counting the
    # union of the tensor-parallel shards it runs of a layer: shard q of t is the finer shards
    # j = q mod t
    assert [m.param_bytes for m in plan.memory] == weights_held(plan, g)
    levelled = all(g.metaop(s.metaop).level == w.level for w, s in plan.slices())
    if planner == "sequential" or (planner == "spindle" and levelled):
        # level by level, C* bounds any schedule; optimus, distmm and Spindle's fused
        # candidate (schedules.fused_waves) overlap levels of different tasks or towers, so the sum
        # of per-level C* does not bound them
        assert plan.estimated_iteration_ms >= plan.lower_bound_ms * (1 - 1e-9)


def weights_held(plan, g):
    """Per rank, the bytes of the weights it holds, from the plan's slices alone."""
    shards = {}
    for _, s in plan.slices():
        m = g.metaop(s.metaop)
        t = tp_degree(s.strategy)
        size = tp_group_size(len(s.ranks), s.strategy)
        for i, r in enumerate(s.ranks):
            for layer in range(m.first_layer + s.first, m.first_layer + s.last):
                shards.setdefault((m.module, layer, r), set()).add((t, i % size))
    parts = math.lcm(*(t for held in shards.values() for t, _ in held))
    per_layer = {}  # a module's layer: the most parameters any of its MetaOps counts
    for m in g.metaops:
        per_layer[m.module] = max(per_layer.get(m.module, 0), m.params_per_layer)
    held = [Fraction(0)] * plan.num_devices
    for (module, _, r), ways in shards.items():
        finer = {j for j in range(parts) for t, q in ways if j % t == q}
        held[r] += Fraction(len(finer), parts) * per_layer[module] * 2
    return [round(b) for b in held]
