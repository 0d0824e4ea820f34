"""Baselines in the plan format: sequential, optimus, distmm (our notes §11)."""

from __future__ import annotations

import pytest
from plan_builders import alpha_beta_curve, cluster, curve, graph, metaop, profile

from spindle_cli.planner.api import make_plan
from spindle_cli.planner.consistency import check_recorded
from spindle_cli.planner.options import PlanOptions


def two_tasks():
    # task a: 8 operators of 4 / n ms; task b: 2 operators of 4 / n ms (B = 4: counts 1, 2, 4)
    g = graph([metaop("a/x", layers=8, batch=4), metaop("b/y", layers=2, batch=4)])
    p = profile([alpha_beta_curve("a/x", 4, 0.0, 1.0), alpha_beta_curve("b/y", 4, 0.0, 1.0)])
    return g, p


def test_sequential_runs_every_metaop_on_the_whole_cluster_in_task_order():
    g = graph([metaop("a/x", layers=3, batch=6), metaop("a/z", level=1, layers=1, batch=6,
                                                         preds=("a/x",)),
               metaop("b/y", layers=2, batch=8)])
    p = profile([alpha_beta_curve("a/x", 6, 0.5, 1.0), alpha_beta_curve("a/z", 6, 0.1, 1.0),
                 alpha_beta_curve("b/y", 8, 0.2, 2.0)])
    plan = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="sequential"))
    got = [[(s.metaop, len(s.ranks), s.first, s.last) for s in w.slices] for w in plan.waves]
    # B = 6 on 4 devices: the largest valid count is 3; B = 8 can use all 4
    assert got == [[("a/x", 3, 0, 3)], [("a/z", 3, 0, 1)], [("b/y", 4, 0, 2)]]
    expected = 3 * (0.5 + 6 / 3) + (0.1 + 6 / 3) + 2 * (0.2 + 2.0 * 8 / 4)
    assert plan.estimated_iteration_ms == pytest.approx(expected)


def test_optimus_gives_devices_by_largest_marginal_gain():
    g, p = two_tasks()
    plan = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="optimus"))
    sizes = {s.metaop: len(s.ranks) for _, s in plan.slices()}
    # from (1, 1): a gains (32 - 16) / 1 > b's (8 - 4) / 1, so a -> 2; a's next step (4)
    # needs 2 more devices but only 1 is left, so b -> 2
    assert sizes == {"a/x": 2, "b/y": 2}
    # both tasks run concurrently: the iteration is the longer task, 8 x 4 / 2 = 16 ms
    assert plan.estimated_iteration_ms == pytest.approx(16.0)
    assert plan.waves[0].slices[0].ranks != plan.waves[0].slices[1].ranks


def test_optimus_list_schedules_more_tasks_than_devices():
    g = graph([metaop("a/x", layers=4, batch=4), metaop("b/y", layers=2, batch=4),
               metaop("c/z", layers=2, batch=4)])
    p = profile([alpha_beta_curve(s, 4, 0.0, 1.0) for s in ("a/x", "b/y", "c/z")])
    plan = make_plan(g, p, cluster(per_node=2), options=PlanOptions(planner="optimus"))
    assert all(len(s.ranks) == 1 for _, s in plan.slices())
    # a (16 ms) on one device; b then c (8 + 8 ms) on the other
    assert plan.estimated_iteration_ms == pytest.approx(16.0)


def test_optimus_list_schedules_tasks_that_need_several_devices_on_groups():
    # three tensor-parallel-only tasks (tp2: counts 2, 4) on 4 devices: two groups of 2,
    # the longest task alone on one, the two others in turn on the other
    ms = [metaop("a/x", layers=4, batch=8), metaop("b/y", layers=2, batch=8),
          metaop("c/z", layers=1, batch=8)]
    p = profile([curve(m.id, 8, [(2, 64, 0.0, 1.0, "tp2")]) for m in ms])
    plan = make_plan(graph(ms), p, cluster(per_node=4), options=PlanOptions(planner="optimus"))
    assert {s.metaop: len(s.ranks) for _, s in plan.slices()} == {"a/x": 2, "b/y": 2, "c/z": 2}
    ranks = {s.metaop: set(s.ranks) for _, s in plan.slices()}
    assert ranks["b/y"] == ranks["c/z"] and not ranks["a/x"] & ranks["b/y"]
    # a: 4 x 8 / 2 = 16 ms; b then c: 8 + 4 = 12 ms
    assert plan.estimated_iteration_ms == pytest.approx(16.0)


def test_distmm_balances_towers_then_runs_the_join_on_all_devices():
    # T(n) = 3 + 4 / n: T(2) = 5, T(4) = 4 ms, so towers side by side beat them in turn
    g = graph([metaop("t/a", layers=3, batch=4), metaop("t/b", layers=1, batch=4),
               metaop("t/c", level=1, layers=1, batch=4, preds=("t/a", "t/b"))])
    p = profile([alpha_beta_curve(s, 4, 3.0, 1.0) for s in ("t/a", "t/b", "t/c")])
    plan = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="distmm"))
    sizes = {s.metaop: len(s.ranks) for _, s in plan.slices()}
    # (2, 2) and (2, 1) both give a slowest tower of 3 x 5 = 15 ms (in turn on 4 devices:
    # 3 x 4 + 4 = 16); (2, 2) has less total
    assert sizes == {"t/a": 2, "t/b": 2, "t/c": 4}
    towers = [w for w in plan.waves if any(s.metaop == "t/a" for s in w.slices)]
    assert {s.metaop for s in towers[0].slices} == {"t/a", "t/b"}
    assert plan.waves[-1].slices[0].metaop == "t/c"
    assert plan.estimated_iteration_ms == pytest.approx(15.0 + 4.0)


def test_distmm_runs_towers_in_turn_when_side_by_side_computes_slower():
    # A heavy tower beside a one-operator embedding on 4 devices (B = 4: counts 1, 2, 4):
    # side by side the heavy one gets 2 devices, 8 x 2 = 16 ms; in turn 8 x 1 + 1 = 9 ms
    g = graph([metaop("t/vit", layers=8, batch=4), metaop("t/embed", layers=1, batch=4),
               metaop("t/head", level=1, layers=1, batch=4, preds=("t/vit", "t/embed"))])
    p = profile([alpha_beta_curve(s, 4, 0.0, 1.0) for s in ("t/vit", "t/embed", "t/head")])
    distmm = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="distmm"))
    sequential = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner="sequential"))
    assert all(len(s.ranks) == 4 for _, s in distmm.slices())
    assert distmm.estimated_iteration_ms == pytest.approx(8.0 + 1.0 + 1.0)
    assert distmm.estimated_iteration_ms == pytest.approx(sequential.estimated_iteration_ms)


@pytest.mark.parametrize("planner", ["spindle", "sequential", "optimus", "distmm"])
def test_every_planner_reports_the_same_relaxed_bound(planner):
    g, p = two_tasks()
    plan = make_plan(g, p, cluster(per_node=4), options=PlanOptions(planner=planner))
    assert plan.planner == planner
    # only Spindle chooses among candidates (one node: one device bound, and the variants of
    # its schedule)
    if planner == "spindle":
        assert plan.candidate.startswith("level by level, device bound 4")
    else:
        assert plan.candidate == ""
    # both MetaOps scale linearly: C* = total work / N = (32 + 8) / 4
    assert plan.lower_bound_ms == pytest.approx(10.0, rel=1e-9)
    assert plan.estimated_iteration_ms >= plan.lower_bound_ms - 1e-9


def test_optimus_grows_a_task_past_a_member_valid_on_one_device_only():
    """Under --uneven-splits with a prime batch, a MetaOp that gains nothing from more devices
    (a flat curve, as a contrastive loss's) is valid on one device only; Optimus stepped its
    task through the counts valid for every member, so the whole task stayed on one device
    (145.4 ms against 57.7 for the other planners in the case a quality sweep found). It now
    grows the task as long as a member gains, the flat one staying on one device."""
    from spindle_cli.planner.schedules import options_curves

    ms = [metaop("t0/enc", layers=8, batch=7),
          metaop("t0/loss", level=1, layers=1, batch=7, preds=("t0/enc",))]
    g, c = graph(ms), cluster(per_node=3)
    p = profile([alpha_beta_curve("t0/enc", 7, 0.05, 1.0),
                 alpha_beta_curve("t0/loss", 7, 0.1, 0.0)])
    options = PlanOptions(planner="optimus", uneven_splits=True)
    curves = options_curves(g, p, c, options)
    assert curves["t0/loss"].counts[1:] == (1,)  # the flat loss: one device only
    plan = make_plan(g, p, c, options=options)
    counts = {s.metaop: len(s.ranks) for _, s in plan.slices()}
    assert counts == {"t0/enc": 3, "t0/loss": 1}


def _optimus_two_chains(a_ops: int, b_first_ms: float, b_ops: int, b_ms: float):
    """Optimus's plan of two tasks of batch 1 on one device each: a, `a_ops` operators of
    10 ms; b, one of `b_first_ms`, then `b_ops` of `b_ms`."""
    g = graph([metaop("a/x", layers=a_ops, batch=1), metaop("b/e", layers=1, batch=1),
               metaop("b/h", level=1, layers=b_ops, batch=1, preds=("b/e",))])
    p = profile([alpha_beta_curve("a/x", 1, 10.0, 0.0),
                 alpha_beta_curve("b/e", 1, b_first_ms, 0.0),
                 alpha_beta_curve("b/h", 1, b_ms, 0.0)])
    return make_plan(g, p, cluster(per_node=2), options=PlanOptions(planner="optimus"))


def test_optimus_waves_are_shortened_as_spindle_levels_are():
    # a: 3 operators of 10 ms; b: one of 4 ms, then 4 of 6 ms; one device each. Aligned one
    # wave at a time: [a 10 | b 4], [a 20 | b 18], [b 6] = 36 ms. Moving b's last operator
    # into the second wave (24 ms) ends at 34 ms, the third wave gone; each task keeps its
    # order (a MetaOp's operators move only between the waves it runs in)
    plan = _optimus_two_chains(3, 4.0, 4, 6.0)
    assert sum(w.duration_ms for w in plan.waves) == pytest.approx(34.0)
    got = [sorted((s.metaop, s.first, s.last) for s in w.slices) for w in plan.waves]
    assert got == [[("a/x", 0, 1), ("b/e", 0, 1)], [("a/x", 1, 3), ("b/h", 0, 4)]]


def test_a_chain_sits_out_a_wave_its_operator_would_hold_long():
    # a: 2 operators of 10 ms; b: one of 1 ms, then 19 of 1 ms; one device each. Every chain
    # in every wave: [a 10 | b 1], [a 10 | b 10], [b 9] = 29 ms (shortening keeps it). With
    # a sitting out the 1 ms wave: [b 1], [a 20 | b 19] = 21 ms, near each task on its own (20)
    plan = _optimus_two_chains(2, 1.0, 19, 1.0)
    got = [(sorted((s.metaop, s.first, s.last) for s in w.slices), w.duration_ms)
           for w in plan.waves]
    assert got == [([("b/e", 0, 1)], pytest.approx(1.0)),
                   ([("a/x", 0, 2), ("b/h", 0, 19)], pytest.approx(20.0))]


def test_a_wave_left_without_its_lowest_level_slot_takes_the_level_of_the_rest():
    # three tasks side by side on three devices (Optimus): the waves' shortening moves t0/e1's
    # operator out of the wave it shared with t0/h1's, which kept level 0 for a lone level-2
    # slice, and `spindle validate` refused the plan Optimus wrote
    spec = [("t0/e0", 0, 2, 1.0), ("t0/e1", 0, 1, 0.5), ("t0/h0", 1, 2, 5.0),
            ("t0/h1", 2, 4, 2.0), ("t1/e0", 0, 3, 1.0), ("t1/e1", 0, 5, 3.0),
            ("t1/h0", 1, 1, 0.5), ("t1/h1", 2, 4, 1.0), ("t2/e0", 0, 1, 0.5),
            ("t2/e1", 0, 5, 2.0), ("t2/h0", 1, 1, 1.0)]

    def preds(mid, level):
        task = mid.split("/")[0]
        return (f"{task}/e0", f"{task}/e1") if level == 1 else (f"{task}/h0",) if level else ()

    g = graph([metaop(m, level=lv, layers=n, batch=4, preds=preds(m, lv))
               for m, lv, n, _ in spec])
    p = profile([alpha_beta_curve(m, 4, 0.0, beta) for m, _, _, beta in spec])
    plan = make_plan(g, p, cluster(per_node=3), options=PlanOptions(planner="optimus"))
    assert [w.level for w in plan.waves] == [
        min(g.metaop(s.metaop).level for s in w.slices) for w in plan.waves]
    check_recorded(plan, g, PlanOptions.of(plan).memory)
