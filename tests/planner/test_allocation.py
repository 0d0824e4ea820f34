"""The allocator: relaxed optimum C* by bisection and the bi-point split (paper §3.3)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from plan_builders import (
    alpha_beta_curve,
    cluster,
    curve,
    graph,
    metaop,
    profile,
    two_point_curve,
)

from spindle_cli.artifacts.profile import MemoryModel, ProfilePoint
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner import scaling
from spindle_cli.planner.allocation import (
    MIN_GAIN,
    n_lin,
    op_curve,
    op_time_ms,
    single_count,
    split,
)
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.consistency import check_slice_times
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import build_curve
from spindle_cli.planner.schedules import allocate, op_curves, options_curves
from spindle_cli.planner.simulate import simulate

C_MS = 100.0


def worked_example():
    """The paper's Fig. 5a: N = 4, MetaOps with L = 8, 12, 6 and n* = 1.9, 1.5, 0.6.

    With B = 2 the valid counts are {1, 2}. Curves are chosen so that, at C* = 100 ms, the
    interpolated speedups give exactly those n*: MetaOp 1 has T(1) = C/4 and T(2) = 0.9C/7.6
    (so its tuples are 7.6 ops on 2 and 0.4 on 1), MetaOp 2 has T(1) = C/7.2 and
    T(2) = C/16.8 (the text's numbers), MetaOp 3 has T(1) = C/10 (6 ops fill 0.6 C on 1)."""
    g = graph([metaop("a/m1", layers=8, batch=2), metaop("b/m2", layers=12, batch=2),
               metaop("c/m3", layers=6, batch=2)])
    p = profile([two_point_curve("a/m1", 2, C_MS / 4, 0.9 * C_MS / 7.6),
                 two_point_curve("b/m2", 2, C_MS / 7.2, C_MS / 16.8),
                 two_point_curve("c/m3", 2, C_MS / 10, C_MS / 16)])
    return g, p


def test_worked_example_relaxed_optimum_and_n_star():
    g, p = worked_example()
    [level] = allocate(g, op_curves(g, p, 4), 4)
    assert level.c_star_ms == pytest.approx(C_MS, rel=1e-9)
    stars = {a.metaop: a.n_star for a in level.ops}
    assert stars == pytest.approx({"a/m1": 1.9, "b/m2": 1.5, "c/m3": 0.6}, rel=1e-9)
    assert sum(stars.values()) == pytest.approx(4.0)


def test_worked_example_tuples_before_and_after_rounding():
    g, p = worked_example()
    [level] = allocate(g, op_curves(g, p, 4), 4)
    by_id = {a.metaop: a for a in level.ops}
    a1, a2, a3 = by_id["a/m1"], by_id["b/m2"], by_id["c/m3"]
    assert (a1.n_hi, a1.n_lo) == (2, 1)
    assert (a1.ops_hi, a1.ops_lo) == pytest.approx((7.6, 0.4), rel=1e-9)
    assert (a2.n_hi, a2.n_lo) == (2, 1)
    assert (a2.ops_hi, a2.ops_lo) == pytest.approx((8.4, 3.6), rel=1e-9)
    assert (a3.n_hi, a3.n_lo) == (1, 0)  # the dummy lower tuple
    assert (a3.ops_hi, a3.ops_lo) == pytest.approx((6.0, 0.0), abs=1e-9)
    rounded = {a.metaop: [(t.n, t.num_ops) for t in a.tuples] for a in level.ops}
    assert rounded == {"a/m1": [(2, 8)], "b/m2": [(2, 8), (1, 4)], "c/m3": [(1, 6)]}


def test_single_count_puts_every_operator_on_the_majority_tuple():
    g, p = worked_example()
    [level] = allocate(g, op_curves(g, p, 4), 4)
    one = single_count(level)
    # b/m2's 8 + 4 operators on 2 and 1 devices all go to 2; the others had one tuple
    got = {a.metaop: [(t.n, t.num_ops) for t in a.tuples] for a in one.ops}
    assert got == {"a/m1": [(2, 8)], "b/m2": [(2, 12)], "c/m3": [(1, 6)]}
    assert (one.c_star_ms, one.lower_bound_ms) == (level.c_star_ms, level.lower_bound_ms)
    assert [a.n_star for a in one.ops] == [a.n_star for a in level.ops]


def test_bisection_bracket_and_balance_on_alpha_beta_curves():
    # three MetaOps with linear speedup (alpha = 0): n* is proportional to work, C* = W / N
    g = graph([metaop("a/x", layers=4, batch=64), metaop("b/y", layers=2, batch=64),
               metaop("c/z", layers=2, batch=64)])
    p = profile([alpha_beta_curve("a/x", 64, 0.0, 1.0), alpha_beta_curve("b/y", 64, 0.0, 1.0),
                 alpha_beta_curve("c/z", 64, 0.0, 1.0)])
    [level] = allocate(g, op_curves(g, p, 8), 8)
    work = (4 + 2 + 2) * 64.0
    assert level.c_star_ms == pytest.approx(work / 8, rel=1e-9)
    stars = {a.metaop: a.n_star for a in level.ops}
    assert stars == pytest.approx({"a/x": 4.0, "b/y": 2.0, "c/z": 2.0}, rel=1e-9)
    # n* on a valid count: one tuple with every operator
    assert all(len(a.tuples) == 1 and a.tuples[0].num_ops == m.num_layers
               for a, m in zip(level.ops, [g.metaop(a.metaop) for a in level.ops], strict=True))


def test_rounding_keeps_every_operator_and_valid_counts():
    g = graph([metaop("a/x", layers=7, batch=12), metaop("b/y", layers=5, batch=12),
               metaop("c/z", layers=3, batch=12)])
    p = profile([alpha_beta_curve("a/x", 12, 0.5, 1.0), alpha_beta_curve("b/y", 12, 0.2, 0.7),
                 alpha_beta_curve("c/z", 12, 0.1, 0.3)])
    curves = op_curves(g, p, 8)
    [level] = allocate(g, curves, 8)
    for a in level.ops:
        m = g.metaop(a.metaop)
        assert sum(t.num_ops for t in a.tuples) == m.num_layers
        assert a.n_lo <= a.n_star + 1e-9 <= a.n_hi + 2e-9
        for t in a.tuples:
            assert t.n in curves[m.id].counts and 12 % t.n == 0 and t.n <= 8
    # the continuous allocation uses the whole cluster
    assert sum(a.n_star for a in level.ops) == pytest.approx(8.0, rel=1e-6)


def _one_to_two_devices(layers: int):
    """A MetaOp whose valid counts are 1 and 2 (B = 2), T(1) = 2 ms and T(2) = 1 ms."""
    m = metaop("a/x", layers=layers, batch=2)
    oc = op_curve(m, alpha_beta_curve("a/x", 2, 0.0, 1.0), 2, [1, 2])
    assert oc.counts == (0, 1, 2) and (oc.time_at(1), oc.time_at(2)) == (2.0, 1.0)
    return oc


@pytest.mark.parametrize(("layers", "n_star", "c_ms", "ops", "expected"), [
    # n* = 1.5 halves C = 5 ms: 2.5 ms on 2 devices is 2.5 ops, 2.5 ms on 1 device 1.25 ops;
    # rounded half up 3 + 1 = 4 of L = 5, and the residual +1 goes to the (real, non-empty)
    # lower tuple
    (5, 1.5, 5.0, (2.5, 1.25), [(2, 3), (1, 2)]),
    # the same rounding with L = 3: the residual -1 empties the lower tuple
    (3, 1.5, 5.0, (2.5, 1.25), [(2, 3)]),
    # n* = 1.75 of C = 4 ms: 3 ops on 2 devices, 0.5 on 1 (rounded up to 1); L = 2 leaves a
    # residual of -2, more than the lower tuple holds, so the upper one gives up the rest
    (2, 1.75, 4.0, (3.0, 0.5), [(2, 2)]),
    # n* = 1.75 of C = 3.2 ms: 2.4 ops on 2 devices (rounded to 2), 0.4 on 1 (rounded to 0):
    # the residual +1 of L = 3 goes to the upper tuple, since the lower one is empty
    (3, 1.75, 3.2, (2.4, 0.4), [(2, 3)]),
])
def test_split_rounding_residual_goes_to_the_lower_tuple(layers, n_star, c_ms, ops, expected):
    a = split(_one_to_two_devices(layers), n_star, c_ms)
    assert (a.n_hi, a.n_lo) == (2, 1)
    assert (a.ops_hi, a.ops_lo) == pytest.approx(ops, rel=1e-12)
    assert [(t.n, t.num_ops) for t in a.tuples] == expected
    # rounding keeps every operator, none negative
    assert sum(t.num_ops for t in a.tuples) == layers
    assert all(t.num_ops > 0 for t in a.tuples)


def test_n_lin_is_infinite_beyond_the_largest_valid_count():
    m = metaop("a/x", layers=2, batch=4)
    c = alpha_beta_curve("a/x", 4, 1.0, 1.0)
    oc = op_curve(m, c, 16, scaling.valid_counts(c, 16))
    assert oc.counts == (0, 1, 2, 4)
    assert n_lin(oc, 2 * scaling.time_ms(c, 4)) <= 4.0
    assert math.isinf(n_lin(oc, 2 * scaling.time_ms(c, 4) * 0.99))


def test_level_with_too_few_valid_counts_leaves_devices_idle():
    # batch 2 caps the MetaOp at 2 devices; on 8 devices C* is its time at 2
    g = graph([metaop("a/x", layers=3, batch=2)])
    p = profile([alpha_beta_curve("a/x", 2, 1.0, 2.0)])
    [level] = allocate(g, op_curves(g, p, 8), 8)
    assert level.c_star_ms == pytest.approx(3 * (1.0 + 2.0 * 2 / 2), rel=1e-9)
    assert [(t.n, t.num_ops) for t in level.ops[0].tuples] == [(2, 3)]


def test_uneven_splits_allow_any_count_and_charge_the_largest_share():
    c = alpha_beta_curve("a/x", 10, 0.0, 1.0)
    assert scaling.valid_counts(c, 8) == [1, 2, 5]
    assert scaling.valid_counts(c, 8, uneven=True) == list(range(1, 9))
    # 10 rows on 4 devices: the slowest device has ceil(10 / 4) = 3 rows
    assert op_time_ms(c, 4, uneven=True) == pytest.approx(3.0)
    assert op_time_ms(c, 5, uneven=True) == pytest.approx(2.0)


def test_counts_no_faster_than_a_smaller_one_are_not_offered():
    # B = 32 with uneven splits: 16 to 31 devices all run 2 rows each, as slow as 16
    c = alpha_beta_curve("a/x", 32, 0.0, 1.0)
    m = metaop("a/x", layers=8, batch=32)
    oc = op_curve(m, c, 32, scaling.valid_counts(c, 32, uneven=True), uneven=True)
    assert oc.counts == (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32)
    assert all(a > b for a, b in zip(oc.times_ms[1:], oc.times_ms[2:], strict=False))


def test_a_flat_curve_keeps_its_evenly_split_counts():
    # a loss that takes as long on any count still runs on the whole cluster in a sequential
    # plan and in a task's group: only counts that uneven splits add are pruned
    c = alpha_beta_curve("a/loss", 8, 1.0, 0.0)
    m = metaop("a/loss", layers=1, batch=8)
    for uneven in (False, True):
        oc = op_curve(m, c, 8, scaling.valid_counts(c, 8, uneven=uneven), uneven=uneven)
        assert oc.counts == (0, 1, 2, 4, 8)
    plan = make_plan(graph([m]), profile([c]), cluster(per_node=8),
                     options=PlanOptions(planner="sequential", uneven_splits=True))
    assert [len(s.ranks) for _, s in plan.slices()] == [8]


def test_uneven_splits_do_not_stall_the_allocation_on_flat_counts():
    # Two such MetaOps on 24 devices: every device is given out (sum n* = N), and C* is no
    # longer than with the even counts, a subset of the uneven ones: the staircase counts
    # (11: 3 rows each) lie below the envelope, where 8 and 16 devices time-shared are faster
    g = graph([metaop("a/x", layers=8, batch=32), metaop("b/y", layers=8, batch=32)])
    p = profile([alpha_beta_curve("a/x", 32, 0.0, 1.0), alpha_beta_curve("b/y", 32, 0.0, 1.0)])
    [even] = allocate(g, op_curves(g, p, 24), 24)
    [uneven] = allocate(g, op_curves(g, p, 24, uneven=True), 24)
    assert sum(a.n_star for a in uneven.ops) == pytest.approx(24.0, rel=1e-6)
    assert uneven.c_star_ms == pytest.approx(uneven.lower_bound_ms, rel=1e-9)
    assert uneven.c_star_ms <= even.c_star_ms * (1 + 1e-9)
    for a in uneven.ops:
        assert {t.n for t in a.tuples} == {8, 16}


def flat_and_steep(embed_params: int = 1000, enc: str = "b/enc"):
    """A level where C* is a flat MetaOp's time (a/embed: 1 ms on any count, 0.008% faster
    on 8 devices than on 1) and `enc` needs less than one device to finish by then."""
    g = graph([metaop("a/embed", layers=1, batch=8, params=embed_params),
               metaop(enc, layers=1, batch=8)])
    p = profile([alpha_beta_curve("a/embed", 8, 1.0, 1e-5),
                 alpha_beta_curve(enc, 8, 0.0, 0.1)])
    return g, p


def test_spare_devices_are_not_spent_on_a_flat_curve():
    g, p = flat_and_steep()
    curves = op_curves(g, p, 8)
    [fewest] = allocate(g, curves, 8)
    [spread] = allocate(g, curves, 8, spread=True)
    assert fewest.c_star_ms == spread.c_star_ms < curves["a/embed"].time_at(1)
    embed, enc = fewest.ops
    # one device finishes within MIN_GAIN of C*: the level's 7 spare devices stay idle
    assert [(t.n, t.num_ops) for t in embed.tuples] == [(1, 1)]
    assert curves["a/embed"].time_at(1) <= fewest.c_star_ms * (1 + MIN_GAIN)
    # the relaxed optimum itself gives them to the flat MetaOp (sum n* = N), as asked
    assert sum(a.n_star for a in spread.ops) == pytest.approx(8.0, rel=1e-6)
    assert all(t.n >= 4 for t in spread.ops[0].tuples)
    # a MetaOp that needs its devices gets the same either way
    assert spread.ops[1] == enc and enc.n_star < 1


def test_tensor_parallel_counts_must_be_multiples_of_the_degree():
    c = curve("a/x", 8, [(1, 2, 0.0, 1.0, "dp"), (2, 64, 0.5, 0.9, "tp2")])
    m = metaop("a/x", layers=2, batch=8)
    oc = op_curve(m, c, 16, scaling.valid_counts(c, 16))
    # n = 2 is still the dp piece; above, tp2 needs even n with (n / 2) | 8: 6 is not valid
    assert oc.counts == (0, 1, 2, 4, 8, 16)
    assert [scaling.strategy(c, n) for n in oc.counts[1:]] == ["dp", "dp", "tp2", "tp2", "tp2"]


@pytest.mark.parametrize("batch", [1, 6, 12, 64, 96, 1000])
@pytest.mark.parametrize("uneven", [False, True])
def test_fast_valid_counts_match_scaling(batch, uneven):
    from spindle_cli.planner.allocation import valid_counts

    curves = [
        alpha_beta_curve("a", batch, 0.1, 1.0),
        curve("b", batch, [(1, 4, 0.0, 1.0, "dp"), (4, 16, 0.5, 0.9, "tp2"),
                           (16, 64, 0.6, 0.8, "tp4")]),
        curve("c", batch, [(2, 8, 0.0, 1.0, "tp2")]),
    ]
    for c in curves:
        assert valid_counts(c, 48, uneven=uneven) == scaling.valid_counts(c, 48, uneven=uneven)


def test_analytic_form_matches_the_interpolated_one_on_linear_curves():
    from spindle_cli.planner.allocation import allocate_level, allocate_level_analytic

    # T(n) = beta * B / n: the speedup is exactly n, so the interpolated and the analytic n*
    # coincide (n*_m = W_m / C with C = sum W / N) and so do the tuples
    g = graph([metaop("a/x", layers=6, batch=8), metaop("b/y", layers=9, batch=8),
               metaop("c/z", layers=5, batch=8)])
    p = profile([alpha_beta_curve("a/x", 8, 0.0, 1.0), alpha_beta_curve("b/y", 8, 0.0, 0.5),
                 alpha_beta_curve("c/z", 8, 0.0, 0.3)])
    curves = op_curves(g, p, 8)
    ocs = [curves[m.id] for m in g.metaops]
    plain, analytic = allocate_level(0, ocs, 8), allocate_level_analytic(0, ocs, 8)
    # W = 6 * 8, 9 * 4, 5 * 2.4 = 48, 36, 12 ms; C = 96 / 8 = 12 ms; n* = 4, 3, 1
    assert plain.c_star_ms == pytest.approx(12.0) and analytic.c_star_ms == plain.c_star_ms
    assert [a.n_star for a in analytic.ops] == pytest.approx([4.0, 3.0, 1.0])
    assert [a.tuples for a in analytic.ops] == [a.tuples for a in plain.ops]


def test_analytic_form_follows_equation_ten():
    from spindle_cli.planner.allocation import allocate_level_analytic, analytic_optimum_ms

    g = graph([metaop("a/x", layers=12, batch=8), metaop("b/y", layers=7, batch=8)])
    p = profile([alpha_beta_curve("a/x", 8, 0.4, 1.0), alpha_beta_curve("b/y", 8, 0.1, 0.2)])
    curves = op_curves(g, p, 8)
    ocs = [curves[m.id] for m in g.metaops]
    level = allocate_level_analytic(0, ocs, 8)
    c_ms = analytic_optimum_ms(ocs, 8)
    assert sum(a.n_star for a in level.ops) == pytest.approx(8.0)
    for a, oc in zip(level.ops, ocs, strict=True):
        L = oc.metaop.num_layers
        assert sum(t.num_ops for t in a.tuples) == L
        assert a.n_lo <= a.n_star <= a.n_hi and a.n_hi in oc.counts
        if a.n_lo > 0:
            t_lo, t_hi = oc.time_at(a.n_lo), oc.time_at(a.n_hi)
            # (10a) and (10b) before rounding: L = l-bar + l, C = T(n_hi) l-bar + T(n_lo) l
            assert a.ops_hi + a.ops_lo == pytest.approx(L)
            assert t_hi * a.ops_hi + t_lo * a.ops_lo == pytest.approx(c_ms)


def test_analytic_form_gives_out_every_device_past_a_metaops_last_count():
    # a/x's batch ends its counts at 8, where it takes 10 ms: the interpolated form cannot
    # finish sooner (C* = 10), but equation ten's continuous n runs on past the last count,
    # so its C is where the two MetaOps' n add up to N (4 ms), not a/x's time at 8
    from spindle_cli.planner.allocation import allocate_level_analytic, analytic_optimum_ms

    g = graph([metaop("a/x", layers=1, batch=8), metaop("b/y", layers=1, batch=64)])
    p = profile([alpha_beta_curve("a/x", 8, 0.0, 10.0), alpha_beta_curve("b/y", 64, 0.0, 0.5)])
    curves = op_curves(g, p, 16)
    ocs = [curves["a/x"], curves["b/y"]]
    [level] = allocate(g, curves, 16)
    assert level.c_star_ms == pytest.approx(10.0)
    assert analytic_optimum_ms(ocs, 16) == pytest.approx(4.0)
    analytic = allocate_level_analytic(0, ocs, 16)
    assert sum(a.n_star for a in analytic.ops) == pytest.approx(16.0)


def test_lower_bound_holds_when_speedup_is_superlinear():
    # Data parallel scales poorly to 2 devices (T = 4, 3 ms); tensor parallel of degree 2 on 4
    # devices is much faster (0.5 ms): speedups 1, 1.33, 8 are not concave. Running the two
    # MetaOps one after the other on all 4 devices takes 2 x 0.5 = 1 ms. The paper's C*
    # (interpolating between consecutive valid counts) says 3 ms; the bound on the concave
    # envelope says 1 ms, which the sequential plan reaches.
    shape = [(1, 2, 2.0, 1.0, "dp"), (2, 4, -2.0, 5.0, "tp2")]
    g = graph([metaop("a/x", layers=1, batch=2), metaop("b/y", layers=1, batch=2)])
    p = profile([curve("a/x", 2, shape), curve("b/y", 2, shape)])
    [level] = allocate(g, op_curves(g, p, 4), 4)
    assert level.c_star_ms == pytest.approx(3.0, rel=1e-9)
    assert level.lower_bound_ms == pytest.approx(1.0, rel=1e-9)
    plan = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="sequential"))
    assert plan.estimated_iteration_ms == pytest.approx(1.0)
    assert plan.lower_bound_ms == pytest.approx(1.0, rel=1e-9)


def test_lower_bound_is_c_star_for_concave_speedups():
    g, p = worked_example()
    # MetaOps 2 and 3 of the worked example have concave speedups (MetaOp 1's is superlinear)
    g2 = graph([metaop("b/m2", layers=12, batch=2), metaop("c/m3", layers=6, batch=2)])
    p2 = profile([p.curve("b/m2"), p.curve("c/m3")])
    [level] = allocate(g2, op_curves(g2, p2, 4), 4)
    assert level.lower_bound_ms == pytest.approx(level.c_star_ms, rel=1e-9)


@pytest.mark.parametrize("tensor_parallel", [True, False])
def test_without_tensor_parallelism_only_data_parallel_counts_are_planned(tensor_parallel):
    # batch 2: data parallelism ends at 2 devices, tensor parallelism (tp2) goes on to 4
    c = curve("a/x", 2, [(1, 2, 0.0, 1.0, "dp"), (2, 4, 0.1, 0.9, "tp2")])
    g = graph([metaop("a/x", layers=4, batch=2)])
    options = PlanOptions(tensor_parallel=tensor_parallel)
    curves = op_curves(g, profile([c]), 4, tensor_parallel=tensor_parallel)
    assert curves["a/x"].counts == ((0, 1, 2, 4) if tensor_parallel else (0, 1, 2))
    plan = make_plan(g, profile([c]), cluster(per_node=4), options=options)
    strategies = {s.strategy for w in plan.waves for s in w.slices}
    assert ("tp2" in strategies) == tensor_parallel
    assert ("tensor_parallel" in plan.options) == (not tensor_parallel)
    assert PlanOptions.of(plan) == options


DP_MS = {1: 8.0, 2: 4.2, 4: 2.3, 8: 1.4}
"""Data-parallel points of `_tp_fastest_at_eight`'s profile; tp2 is a little faster at 8."""


def _profiled(batch: int, dp: dict[int, float | None], tp2: dict[int, float]):
    """A graph of one MetaOp and a profile fitted from these points (None: infeasible)."""
    m = metaop("a/x", layers=4, batch=batch)
    points = [ProfilePoint(num_devices=n, strategy=st, feasible=t is not None,
                           time_ms=t or 0.0, peak_memory_bytes=0,
                           note="" if t is not None else "timed out")
              for st, times in (("dp", dp), ("tp2", tp2)) for n, t in times.items()]
    counts = tuple(sorted(dp))
    c = build_curve(m, points, counts=counts, validate=False,
                    memory=MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                       activation_bytes_per_sample=0))
    return graph([m]), replace(profile([c]), counts=counts)


def _tp_fastest_at_eight():
    return _profiled(8, DP_MS, {2: 4.6, 4: 2.5, 8: 1.3})


def test_without_tensor_parallelism_a_count_fitted_with_it_runs_its_data_parallel_point():
    # the profile's curve runs tp2 at 8 devices (1.3 ms against data parallel's 1.4): a plan
    # without tensor parallelism still has 8 devices, at the data-parallel time, not 4
    g, p = _tp_fastest_at_eight()
    assert scaling.strategy(p.curve("a/x"), 8) == "tp2"
    assert op_curves(g, p, 8)["a/x"].time_at(8) == pytest.approx(1.3)
    without = op_curves(g, p, 8, tensor_parallel=False)["a/x"]
    assert without.counts == (0, 1, 2, 4, 8)
    assert {scaling.strategy(without.curve, n) for n in without.counts[1:]} == {"dp"}
    for n, t in DP_MS.items():
        assert without.time_at(n) == pytest.approx(t)
    # the plan, the simulator and validate's slice times read the same curve
    eight = cluster(per_node=8)
    options = PlanOptions(tensor_parallel=False)
    plan = make_plan(g, p, eight, options=options)
    assert {(len(s.ranks), s.strategy) for _, s in plan.slices()} == {(8, "dp")}
    assert plan.estimated_iteration_ms == pytest.approx(4 * DP_MS[8])
    check_slice_times(plan, options_curves(g, p, eight, options))
    assert simulate(plan, g, p, eight).compute_ms == pytest.approx(plan.estimated_iteration_ms)


def test_a_curve_is_not_fitted_again_to_end_before_counts_it_ran_data_parallel():
    # the data-parallel point at 4 devices timed out, where tp2 ran: fitted again from the
    # data-parallel points the curve would end at 2 (a diff review), where the profile's
    # runs 8 and 16 data parallel
    g, p = _profiled(16, {1: 8.0, 2: 4.2, 4: None, 8: 1.4, 16: 1.0},
                     {2: 4.5, 4: 2.4, 8: 1.5, 16: 1.2})
    assert [scaling.strategy(p.curve("a/x"), n) for n in (1, 2, 4, 8, 16)] == [
        "dp", "dp", "tp2", "dp", "dp"]
    without = op_curves(g, p, 16, tensor_parallel=False)["a/x"]
    assert without.counts == (0, 1, 2, 8, 16)
    assert without.curve is p.curve("a/x")


def test_tensor_parallel_degrees_must_divide_the_island_size():
    # a profile made for islands of 8 (tp4 from 4 devices on), planned on islands of 2
    c = curve("a/x", 8, [(1, 4, 1.0, 1.0, "dp"), (4, 64, 1.1, 0.9, "tp4")])
    g = graph([metaop("a/x", layers=2, batch=8)])
    assert op_curves(g, profile([c]), 8)["a/x"].counts == (0, 1, 2, 4, 8)
    assert op_curves(g, profile([c]), 8, island_size=2)["a/x"].counts == (0, 1, 2, 4)
    # every planner plans data-parallel slices there (tp4 groups fit in no island)
    two = cluster(num_nodes=2, per_node=4, island=2)
    for planner in ("spindle", "sequential", "optimus", "distmm"):
        plan = make_plan(g, profile([c]), two, options=PlanOptions(planner=planner))
        assert {s.strategy for _, s in plan.slices()} == {"dp"}, planner


def test_a_curve_of_tensor_parallel_counts_only_says_why_it_has_none():
    # tp2 everywhere, islands of 3: three tp2 slices on 6 devices would need three islands
    c = curve("a/x", 16, [(1, 1 << 20, 1.0, 2.0, "tp2")])
    g = graph([metaop("a/x", layers=2, batch=16)])
    with pytest.raises(PlanInfeasible, match=r"no valid device count <= 6 \(batch 16, strategy "
                       r"tp2; no tensor-parallel degree of its curve \(2\) divides the island "
                       r"size 3\)"):
        make_plan(g, profile([c]), cluster(num_nodes=1, per_node=6, island=3))
    with pytest.raises(PlanInfeasible, match="tp2; tensor parallelism is off"):
        make_plan(g, profile([c]), cluster(num_nodes=1, per_node=4),
                  options=PlanOptions(tensor_parallel=False))


def test_c_star_is_bounded_by_the_fastest_valid_count_not_the_last_alpha():
    # batch 2 ends the counts at 2 devices, where the first piece gives 1 + 1 * 2 / 2 = 2 ms;
    # the last piece's alpha (2.5 ms, more fixed cost at more devices) is no lower bound
    c = curve("a/x", 2, [(1, 2, 1.0, 1.0, "dp"), (2, 1 << 20, 2.5, 0.1, "dp")])
    g = graph([metaop("a/x", layers=4, batch=2)])
    curves = op_curves(g, profile([c]), 4)
    (level,) = allocate(g, curves, 4)
    assert level.c_star_ms == pytest.approx(4 * 2.0)
    assert level.lower_bound_ms == pytest.approx(4 * 2.0)
    assert [(t.n, t.num_ops) for x in level.ops for t in x.tuples] == [(2, 4)]
    plan = make_plan(g, profile([c]), cluster(per_node=4))
    assert plan.estimated_iteration_ms >= plan.lower_bound_ms - 1e-9


def test_c_star_at_the_fastest_count_of_the_slowest_metaop_is_that_count_exactly():
    # a/embed cannot finish faster than on its last valid count (8, the batch), and the level
    # has devices over there: C* is its time on 8 and its n* that count, one tuple (bisection
    # closed in from above and left n* a hair below 8, with a second tuple of ~0 operators)
    g, p = flat_and_steep()
    curves = op_curves(g, p, 16)
    for spread in (False, True):
        (level,) = allocate(g, curves, 16, spread=spread)
        assert level.c_star_ms == curves["a/embed"].time_at(8)
    (level,) = allocate(g, curves, 16, spread=True)
    embed = level.ops[0]
    assert embed.n_star == 8.0
    assert [(t.n, t.num_ops) for t in embed.tuples] == [(8, 1)]
