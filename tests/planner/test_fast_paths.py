"""The planner's fast paths agree with the plain rules they replace: the row merge of
`row_flows`, the vectorized `align_fill`, the iteration-only simulation with its give-up
bound (`simulated_cost`), `level_waves` reusing traced variants, and candidates placing
their leading waves as earlier candidates did (`placement.PlacedWaves`)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import _sim_fixtures as fx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples
from test_properties import problems
from test_simulate_properties import plans

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.artifacts.plan import ParamGroup, Slice, Transfer, Wave, tp_groups
from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner import api, placement, schedules, search
from spindle_cli.planner.alignment import align_fill
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.memory import split_rows
from spindle_cli.planner.network import Network, row_flows
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.simulate import simulate, simulated_cost
from spindle_cli.planner.waves import VARIANTS, schedule_level, traced_wavefront_level

_EPS = 1e-9


def row_flows_by_every_pair(num_bytes, src_ranks, src_strategy, dst_ranks, dst_strategy,
                            num_rows):
    """The rule of `row_flows` checked on every (consumer group, producer group) pair."""
    src_groups = tp_groups(src_ranks, src_strategy)
    dst_groups = tp_groups(dst_ranks, dst_strategy)
    out = []
    for di, (dg, (dlo, dhi)) in enumerate(zip(dst_groups, split_rows(num_rows, len(dst_groups)),
                                              strict=True)):
        for sg, (slo, shi) in zip(src_groups, split_rows(num_rows, len(src_groups)),
                                  strict=True):
            overlap = min(dhi, shi) - max(dlo, slo)
            if overlap <= 0:
                continue
            piece = num_bytes * overlap // num_rows
            for j, d in enumerate(dg):
                s = d if d in sg else sg[(di + j) % len(sg)]
                if s != d:
                    out.append((s, d, piece))
    return out


rank_sets = st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True).map(
    lambda r: tuple(sorted(r)))


@settings(max_examples=examples(200), deadline=None)
@given(num_bytes=st.integers(0, 10**6), src=rank_sets, dst=rank_sets,
       src_strategy=st.sampled_from(["dp", "tp2", "tp4"]),
       dst_strategy=st.sampled_from(["dp", "tp2", "tp4"]), num_rows=st.integers(1, 20))
def test_row_flows_merge_walk_matches_every_pair(num_bytes, src, dst, src_strategy,
                                                 dst_strategy, num_rows):
    fast = row_flows(num_bytes, src, src_strategy, dst, dst_strategy, num_rows)
    assert list(fast) == row_flows_by_every_pair(num_bytes, src, src_strategy, dst,
                                                 dst_strategy, num_rows)


def align_fill_one_span_at_a_time(op_times_ms, num_ops, devices, every_operator):
    """The rule of `align_fill`, one candidate span at a time."""
    pairs = list(zip(op_times_ms, num_ops, strict=True))
    if every_operator and sum(num_ops) <= 4096:
        spans = sorted({t * j for t, k in pairs for j in range(1, k + 1)})
    else:
        spans = sorted({t * k for t, k in pairs})
    best = None
    for span in spans:
        ops = [min(k, max(1, math.floor(span / t + _EPS))) for t, k in pairs]
        real = max(t * k for (t, _), k in zip(pairs, ops, strict=True))
        busy = sum(n * t * k for n, (t, _), k in zip(devices, pairs, ops, strict=True))
        share = busy / (sum(devices) * real)
        if best is None or share > best[0] + 1e-12:
            best = (share, ops)
    return best[1]


@settings(max_examples=examples(200), deadline=None)
@given(tuples=st.lists(st.tuples(st.floats(0.01, 10.0), st.integers(1, 12),
                                 st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=6),
       every_operator=st.booleans())
def test_align_fill_matches_the_span_by_span_rule(tuples, every_operator):
    times, ops, devices = (list(x) for x in zip(*tuples, strict=True))
    assert align_fill(times, ops, devices, every_operator=every_operator) == \
        align_fill_one_span_at_a_time(times, ops, devices, every_operator)


@settings(max_examples=examples(60), deadline=None)
@given(plan=plans(), batch=st.integers(1, 9), num_nodes=st.sampled_from([1, 2]),
       latency_s=st.sampled_from([0.0, 1e-5]), cut=st.floats(0.0, 1.5))
def test_iteration_only_simulation_and_its_give_up_bound(plan, batch, num_nodes, latency_s,
                                                         cut):
    g, p, c = fx.graph(batch), fx.profile(batch), fx.cluster(latency_s=latency_s,
                                                              num_nodes=num_nodes)
    result = simulate(plan, g, p, c)
    full = result.iteration_ms
    assert simulated_cost(plan, g, p, c) == (full, result.transfer_ms)
    give_up_ms = cut * full
    bounded, transfer_ms = simulated_cost(plan, g, p, c, give_up_ms=give_up_ms)
    if full <= give_up_ms:
        assert (bounded, transfer_ms) == (full, result.transfer_ms)
    else:
        # stopped early or not: at or above the bound it gave up on, never above the truth
        assert give_up_ms <= bounded <= full


def test_a_give_up_bound_rounded_above_the_iteration_is_shaved_below_it():
    """The bound sums the clock and the compute left in another order than the simulation to
    the end: here it rounded to 52.50000000000001 against the iteration's 52.5 (found by the
    property test above with more examples)."""
    plan = fx.plan((0,), (0,), enc_sync_bytes=0, head_sync_bytes=0)
    g, p, c = fx.graph(7), fx.profile(7), fx.cluster(num_nodes=1)
    full = simulate(plan, g, p, c).iteration_ms
    bounded, transfer_ms = simulated_cost(plan, g, p, c, give_up_ms=0.0)
    assert transfer_ms == math.inf and full * (1 - 1e-9) < bounded <= full


def test_give_up_counts_the_work_left_after_the_clock():
    # the optimizer step follows the last backward: a bar it alone crosses is given up on at
    # the end of the backward, before the gradient sync is simulated
    g, c = fx.graph(), fx.cluster()
    p = replace(fx.profile(), optimizer=OptimizerCost(ms_per_tensor=40.0,
                                                      ms_per_million_params=0.0))
    result = simulate(fx.plan(), g, p, c)
    assert result.optimizer_ms == 40.0
    give_up_ms = result.iteration_ms - result.optimizer_ms / 2
    steps = []
    step = Network._step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Network, "_step", lambda net: (steps.append(net.now_s), step(net))[1])
        bounded, transfer_ms = simulated_cost(fx.plan(), g, p, c, give_up_ms=give_up_ms)
    assert transfer_ms == math.inf and give_up_ms < bounded <= result.iteration_ms
    # no flow was simulated past the end of the backward
    assert max(steps) * 1e3 <= result.iteration_ms - result.optimizer_ms - result.sync_ms


def level_waves_by_every_variant(g, curves, allocs, num_devices, max_ops):
    """`schedules.level_waves` without reuse: every variant scheduled and shortened."""
    preds = {m.id: m.predecessors for m in g.metaops}
    finished: set[str] = set()
    levels = []
    for a in allocs:
        best = None
        for rule, rounding, extension in VARIANTS:
            trial = schedule_level(a, curves, num_devices, preds, set(finished), sort_rule=rule,
                                   rounding=rounding, extension=extension, max_ops=max_ops)
            if best is None or (sum(w.duration_ms for w in trial)
                                < sum(w.duration_ms for w in best) - 1e-9):
                best = trial
        finished |= {m.id for m in g.metaops if m.level == a.level}
        levels.append(best)
    return levels


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_level_waves_reuse_matches_every_variant(problem):
    g, p, c = problem
    try:
        curves = schedules.op_curves(g, p, c.num_devices)
    except PlanInfeasible:
        return
    allocs = schedules.allocate(g, curves, c.num_devices)
    max_ops = schedules.slice_limits(g, curves, c)
    fast = schedules.level_waves(g, curves, allocs, c.num_devices, max_ops)
    assert fast == level_waves_by_every_variant(g, curves, allocs, c.num_devices, max_ops)
    # a variant a trace covers builds exactly the traced waves
    preds = {m.id: m.predecessors for m in g.metaops}
    finished: set[str] = set()
    for a in allocs:
        traces = {v: traced_wavefront_level(a, curves, c.num_devices, preds, set(finished),
                                            sort_rule=v[0], rounding=v[1], extension=v[2],
                                            max_ops=max_ops) for v in VARIANTS}
        for v, t in traces.items():
            for other in VARIANTS:
                if t.covers(other, v):
                    assert traces[other].waves == t.waves
        finished |= {m.id for m in g.metaops if m.level == a.level}


def test_candidates_place_reused_leading_waves_as_they_would_alone(monkeypatch):
    """multitask-clip 10 tasks on 64 GPUs (candidates share leading waves): every candidate
    `make_plan` assembles with the placements of earlier candidates is the plan, or the
    error, it gets assembled on its own; and some candidates did reuse waves."""
    root = Path(__file__).resolve().parents[2]
    spec = load(str(root / "models" / "multitask-clip.yaml"), ModelSpec)
    c = load(str(root / "clusters" / "a800-8x8.yaml"), ClusterSpec)
    g = build_graph(spec, tasks=list(spec.task_sets["10"]))
    p = analytic_profile(g, c, hardware="a800", counts=[1, 2, 4, 8, 16, 32, 64])
    real_assemble, real_leading = search.assemble, placement.PlacedWaves.leading
    reused = []

    def leading(self, *args, **kwargs):
        found = real_leading(self, *args, **kwargs)
        reused.append(len(found))
        return found

    def outcome(*args, **kwargs):
        try:
            return real_assemble(*args, **kwargs)
        except PlanInfeasible as e:
            return str(e)

    def assemble(*args, placements=None, **kwargs):
        alone = outcome(*args, **kwargs)
        shared = outcome(*args, placements=placements, **kwargs)
        assert shared == alone
        if isinstance(shared, str):
            raise PlanInfeasible(shared)
        return shared

    monkeypatch.setattr(placement.PlacedWaves, "leading", leading)
    monkeypatch.setattr(search, "assemble", assemble)
    api.make_plan(g, p, c)
    assert max(reused) > 0


def test_a_bound_equal_to_the_iteration_is_not_given_up_on():
    # the network checks its clock in seconds against the bound in ms, summed in another
    # order: 10.540125759999999 ms gave up at a bound of itself (found by the property test
    # above with 2000 examples)
    s0 = Slice(id="w0.0", metaop="t/enc", first=0, last=1, ranks=(0,), strategy="dp",
               time_ms=1.0)
    s1 = Slice(id="w1.0", metaop="t/enc", first=1, last=2, ranks=(0, 1), strategy="dp",
               time_ms=1.0)
    s2 = Slice(id="w2.0", metaop="t/head", first=0, last=1, ranks=(0, 2), strategy="dp",
               time_ms=1.0)
    plan = replace(
        fx.plan(),
        waves=tuple(Wave(index=i, level=0 if s.metaop == "t/enc" else 1, start_ms=float(i),
                         duration_ms=1.0, slices=(s,)) for i, s in enumerate((s0, s1, s2))),
        transfers=(Transfer(src="w0.0", dst="w1.0", bytes=6288, src_ranks=(0,),
                            dst_ranks=(0, 1)),
                   Transfer(src="w1.0", dst="w2.0", bytes=6288, src_ranks=(0, 1),
                            dst_ranks=(0, 2))),
        param_groups=(ParamGroup(module="enc", first_layer=0, last_layer=1, ranks=(0,), bytes=0),
                      ParamGroup(module="enc", first_layer=1, last_layer=2, ranks=(0, 1),
                                 bytes=0),
                      ParamGroup(module="head", first_layer=0, last_layer=1, ranks=(0, 2),
                                 bytes=0)))
    g, p, c = fx.graph(2), fx.profile(2), fx.cluster(latency_s=1e-5, num_nodes=1)
    full = simulate(plan, g, p, c)
    assert simulated_cost(plan, g, p, c, give_up_ms=full.iteration_ms) == (
        full.iteration_ms, full.transfer_ms)
