"""The evaluation matrix and dynamic task sets as data (spindle_cli.planner.bench)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner import api, paper_numbers, search
from spindle_cli.planner import bench as lib
from spindle_cli.planner.assemble import place_again
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.simulate import simulate

REPO = Path(__file__).resolve().parents[2]


def model(name: str) -> ModelSpec:
    return load(str(REPO / "models" / f"{name}.yaml"), ModelSpec)


def cluster(name: str) -> ClusterSpec:
    return load(str(REPO / "clusters" / f"{name}.yaml"), ClusterSpec)


def test_matrix_is_the_papers_evaluation():
    cells = {(c.model, c.num_tasks, c.num_devices) for c in lib.matrix()}
    assert len(cells) == 9 + 6 + 2 + 2
    assert ("multitask-clip", 10, 32) in cells and ("ofasys", 7, 8) in cells
    assert ("qwen-val", 3, 64) in cells and ("qwen-val-70b", 3, 256) in cells
    assert {(c.model, c.num_tasks, c.num_devices) for c in lib.matrix(quick=True)} <= cells


def test_every_cell_has_a_shipped_cluster_and_task_set_of_its_size():
    for cfg in lib.matrix():
        assert cluster(cfg.cluster).num_devices == cfg.num_devices
        m = model(cfg.model)
        tasks = cfg.tasks(m)
        assert len(tasks if tasks is not None else m.tasks) == cfg.num_tasks


CLIP4 = lib.BenchConfig(model="multitask-clip", task_set="4", num_tasks=4, num_devices=16)


@pytest.fixture(scope="module")
def clip4_rows():
    return lib.run_config(model("multitask-clip"), cluster("a800-2x8"), CLIP4)


def test_rows_cover_every_variant_and_the_optimum(clip4_rows):
    got = [(r.planner, r.placement) for r in clip4_rows]
    assert got == [*lib.VARIANTS, (lib.OPTIMUM, "-")]
    assert all(r.cluster == "a800-2x8" and r.num_devices == 16 for r in clip4_rows)


def test_speedups_are_relative_to_the_simulated_sequential_plan(clip4_rows):
    seq = next(r for r in clip4_rows if r.planner == "sequential")
    assert seq.iteration_ms is not None, seq.error
    assert seq.speedup_vs_sequential == pytest.approx(1.0)
    for r in clip4_rows:
        if r.iteration_ms is not None:
            assert r.speedup_vs_sequential == pytest.approx(seq.iteration_ms / r.iteration_ms)


def test_rows_agree_with_a_direct_simulation(clip4_rows):
    m, c = model("multitask-clip"), cluster("a800-2x8")
    graph = build_graph(m, tasks=list(m.task_sets["4"]))
    profile = lib.profile_for(graph, c)
    plan, sim, seconds = lib.plan_and_simulate(graph, profile, c, "spindle", "island")
    row = clip4_rows[0]
    assert row.iteration_ms == pytest.approx(simulate(plan, graph, profile, c).iteration_ms)
    assert row.iteration_ms == pytest.approx(sim.iteration_ms)
    assert row.transfer_fraction == pytest.approx(sim.transfer_ms / sim.iteration_ms)
    assert row.gap_to_optimum == pytest.approx(sim.iteration_ms / row.lower_bound_ms)
    assert row.executed_ms == pytest.approx(
        simulate(plan, graph, profile, c, progress="rank").iteration_ms)
    assert row.candidate == plan.candidate and plan.candidate
    # Fig. 10's ablation: the same waves on consecutive ranks
    naive = simulate(place_again(plan, graph, profile, c, placement="sequential"),
                     graph, profile, c)
    assert row.naive_error == ""
    assert row.naive_transfer_fraction == pytest.approx(naive.transfer_fraction)
    assert row.naive_iteration_ms == pytest.approx(naive.iteration_ms)
    # here island placement waits for transfers far less than the same waves placed naively
    assert row.transfer_fraction < 0.6 * row.naive_transfer_fraction
    assert all(r.naive_transfer_fraction is None and r.naive_error == ""
               for r in clip4_rows[1:])
    assert all(r.candidate == "" for r in clip4_rows if r.planner != "spindle")
    assert seconds > 0


def timed_make_plan(monkeypatch) -> list[float]:
    """The seconds of every `search.make_plan_with_cost` call from now on, appended as each
    returns."""
    seconds: list[float] = []
    real = search.make_plan_with_cost

    def make_plan_with_cost(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    monkeypatch.setattr(api, "make_plan_with_cost", make_plan_with_cost)
    return seconds


def test_plan_seconds_cover_spindle_plans_whole_memory_search(monkeypatch):
    m, c = model("tiny-clip"), cluster("a800-1x8")
    graph = build_graph(m, tasks=list(m.task_sets["2"]))
    profile = lib.profile_for(graph, c)
    planned = timed_make_plan(monkeypatch)
    api.fitting_plan_with_cost(graph, profile, c, options=PlanOptions())
    searched = len(planned)
    assert searched > 1  # `spindle plan` plans more than one memory setting here
    planned.clear()
    _, _, seconds = lib.plan_and_simulate(graph, profile, c, "spindle", "island")
    assert len(planned) == searched
    assert seconds >= sum(planned)


def test_optimum_row_is_the_relaxed_lower_bound(clip4_rows):
    opt = clip4_rows[-1]
    assert opt.iteration_ms == opt.lower_bound_ms and opt.lower_bound_ms > 0
    for r in clip4_rows[:-1]:
        assert r.lower_bound_ms == opt.lower_bound_ms
        if r.compute_ms is not None:
            # No schedule computes faster than the relaxed optimum.
            assert r.compute_ms >= opt.lower_bound_ms * (1 - 1e-6)


def test_paper_numbers_sit_beside_the_matching_rows(clip4_rows):
    by = {(r.planner, r.placement): r for r in clip4_rows}
    assert by["spindle", "island"].paper_speedup == 1.22
    assert by["sequential", "island"].paper_speedup == 1.0
    assert by["optimus", "island"].paper_speedup == 1.00
    assert by["spindle", "sequential"].paper_speedup is None
    # Fig. 10 has no 4-task CLIP bar.
    assert by["spindle", "island"].paper_transfer_share is None


def refusing(message: str):
    """A stand-in for a planning function that finds the model infeasible."""
    def refuse(*args, **kwargs):
        raise PlanInfeasible(message)

    return refuse


def tiny_rows() -> list[lib.BenchRow]:
    """The rows of tiny-clip's two tasks on 8 devices."""
    return lib.run_config(model("tiny-clip"), cluster("a800-1x8"),
                          lib.BenchConfig(model="tiny-clip", task_set="2", num_tasks=2,
                                          num_devices=8))


def test_papers_shares_sit_on_the_row_of_the_share_they_compare_with(monkeypatch):
    key = ("tiny-clip", 2, 8)
    monkeypatch.setitem(paper_numbers.FIG10_TRANSFER_SHARE, key, (0.01, 0.05))
    by = {(r.planner, r.placement): r for r in tiny_rows()}
    island = by["spindle", "island"]
    # with placement beside transfer_fraction; without it (the waves held fixed) beside
    # naive_transfer_fraction, both on the island row
    assert island.paper_transfer_share == paper_numbers.transfer_share(*key, "island")
    assert island.paper_naive_transfer_share == paper_numbers.transfer_share(*key, "sequential")
    # a plan made for sequential placement has no figure in the paper
    assert all(r.paper_transfer_share is None and r.paper_naive_transfer_share is None
               for k, r in by.items() if k != ("spindle", "island"))


def test_planning_failures_become_rows_with_the_reason(monkeypatch):
    refuse = refusing("out of memory (test)")

    def slow_refusal(*args, **kwargs):
        time.sleep(0.05)
        refuse()

    monkeypatch.setattr(lib, "fitting_plan_with_cost", slow_refusal)
    rows = tiny_rows()
    failed = rows[:-1]
    assert all(r.iteration_ms is None and r.error == "out of memory (test)" for r in failed)
    # the time planning took to fail, as spindle plan would spend it
    assert all(r.plan_seconds is not None and r.plan_seconds >= 0.05 for r in failed)
    assert all(r.speedup_vs_sequential is None for r in rows)
    assert rows[-1].planner == lib.OPTIMUM and rows[-1].iteration_ms > 0


def test_waves_that_do_not_fit_placed_naively_leave_the_reason(monkeypatch):
    monkeypatch.setattr(lib, "place_again", refusing("out of memory placing t/a (test)"))
    sp = tiny_rows()[0]
    assert (sp.planner, sp.placement) == ("spindle", "island") and sp.iteration_ms is not None
    assert sp.naive_transfer_fraction is None and sp.naive_iteration_ms is None
    assert sp.naive_error == "out of memory placing t/a (test)" and sp.error == ""


def test_dynamic_schedule_replans_at_each_change_to_a_task_set_not_run_before(monkeypatch):
    m = model("tiny-clip")
    m = dataclasses.replace(m, task_sets={**m.task_sets, "1": ("text_vision",)})
    planned = []
    plan_and_simulate = lib.plan_and_simulate

    def counted(graph, profile, cluster_, planner, placement):
        planned.append((planner, len(graph.tasks)))
        return plan_and_simulate(graph, profile, cluster_, planner, placement)

    monkeypatch.setattr(lib, "plan_and_simulate", counted)
    rows = lib.run_dynamic(m, cluster("a800-1x8"), schedule=("2", "1", "2"),
                           iterations_per_phase=10, planners=("spindle", "sequential"))
    assert [(r.planner, r.phase, r.num_tasks) for r in rows] == [
        ("spindle", 0, 2), ("spindle", 1, 1), ("spindle", 2, 2),
        ("sequential", 0, 2), ("sequential", 1, 1), ("sequential", 2, 2)]
    # each task set planned once per planner: the first before training (no replanning), the
    # change to set 1 replanned, the return to set 2 keeps its plan
    assert planned == [("spindle", 2), ("spindle", 1), ("sequential", 2), ("sequential", 1)]
    for r in rows:
        assert r.error == ""
        assert r.phase_ms == pytest.approx(10 * r.iteration_ms)
        assert (r.replan_seconds > 0) == (r.phase == 1), r
    for planner in ("spindle", "sequential"):
        first, _, again = (r for r in rows if r.planner == planner)
        assert again.iteration_ms == first.iteration_ms
    totals = {t.planner: t for t in lib.dynamic_totals(rows)}
    sp = [r for r in rows if r.planner == "spindle"]
    assert totals["spindle"].train_s == pytest.approx(sum(r.phase_ms for r in sp) / 1e3)
    assert totals["spindle"].total_s == pytest.approx(
        totals["spindle"].train_s + sp[1].replan_seconds)


def test_dynamic_total_is_unknown_when_a_phase_failed():
    ok = lib.DynamicRow(planner="p", phase=0, task_set="4", num_tasks=4, iterations=1,
                        iteration_ms=5.0, phase_ms=5.0, replan_seconds=0.5)
    bad = lib.DynamicRow(planner="p", phase=1, task_set="7", num_tasks=7, iterations=1,
                         iteration_ms=None, phase_ms=None, replan_seconds=None, error="x")
    (total,) = lib.dynamic_totals([ok, bad])
    assert total.train_s is None and total.total_s is None and total.replan_s == 0.5


def _phases(planner, iteration_ms, replan_s, iterations=10):
    return [lib.DynamicRow(planner=planner, phase=i, task_set="4", num_tasks=4,
                           iterations=iterations, iteration_ms=iteration_ms,
                           phase_ms=iteration_ms * iterations, replan_seconds=replan_s)
            for i in range(2)]


def test_dynamic_totals_say_from_how_many_iterations_spindle_is_ahead():
    rows = (_phases("spindle", 5.0, 1.0) + _phases("slow", 10.0, 0.25)
            + _phases("faster", 4.0, 0.25) + _phases("lighter", 10.0, 2.0))
    totals = {t.planner: t for t in lib.dynamic_totals(rows)}
    beyond = totals["slow"].spindle_ahead_beyond
    # 1.5 s more replanning, 2 x 5 ms saved per iteration of each phase
    assert beyond == pytest.approx(150)

    def total_s(planner, iteration_ms, iterations):
        mine = [r for r in rows if r.planner == planner]
        return (sum(r.replan_seconds for r in mine)
                + len(mine) * iteration_ms * iterations / 1e3)

    assert total_s("spindle", 5.0, 149) > total_s("slow", 10.0, 149)
    assert total_s("spindle", 5.0, 151) < total_s("slow", 10.0, 151)
    assert totals["faster"].spindle_ahead_beyond is None
    assert totals["lighter"].spindle_ahead_beyond == 0.0
    assert totals["spindle"].spindle_ahead_beyond is None
    failed = lib.dynamic_totals(_phases("spindle", 5.0, 1.0)[:1] + [dataclasses.replace(
        _phases("spindle", 5.0, 1.0)[1], iteration_ms=None, phase_ms=None, error="x")]
        + _phases("slow", 10.0, 0.25))
    assert all(t.spindle_ahead_beyond is None for t in failed)


def test_memory_setting_reads_the_plan_options(clip4_rows):
    m, c = model("multitask-clip"), cluster("a800-2x8")
    graph = build_graph(m, tasks=list(m.task_sets["4"]))
    plan, _, _ = lib.plan_and_simulate(graph, lib.profile_for(graph, c), c, "spindle", "island")
    assert clip4_rows[0].memory == lib.memory_setting(plan)
    opts = dict(plan.options)
    assert lib.memory_setting(dataclasses.replace(plan, options=opts | {"zero": "0"})) == "none"
    both = opts | {"zero": "3", "recompute": "true"}
    assert lib.memory_setting(dataclasses.replace(plan, options=both)) == "zero3+recompute"


def test_paper_number_lookup():
    assert paper_numbers.speedup("multitask-clip", 10, 32, "spindle") == 1.71
    assert paper_numbers.speedup("ofasys", 7, 8, "distmm") == 1.07
    assert paper_numbers.speedup("qwen-val-70b", 3, 256, "optimus") is None
    assert paper_numbers.speedup("tiny-clip", 2, 8, "spindle") is None
    assert paper_numbers.transfer_share("multitask-clip", 10, 16, "sequential") == 0.27
    assert paper_numbers.transfer_share("qwen-val", 3, 32, "island") == 0.017
