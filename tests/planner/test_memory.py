"""Memory strategies: per-rank bytes under each ZeRO stage and recomputation (hand-computed),
the automatic choice of the least aggressive setting that fits, and the qwen-val plans."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from plan_builders import GIB, alpha_beta_curve, cluster, graph, metaop, profile
from test_allocation import flat_and_steep

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, Profile, load
from spindle_cli.artifacts.io import as_written
from spindle_cli.artifacts.plan import PLANNERS
from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.errors import OutOfMemory, PlanInfeasible
from spindle_cli.planner import api, search
from spindle_cli.planner.api import (
    compute_bound_ms,
    fitting_plan_with_cost,
    make_fitting_plan,
    make_plan,
    memory_ladder,
)
from spindle_cli.planner.bench import profile_for
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.memory import (
    Ledger,
    MemoryStrategy,
    kept_bytes_per_sample,
    layer_bytes_per_rank,
    split_state_bytes,
)
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.schedules import options_curves
from spindle_cli.planner.search import make_plan_with_cost
from spindle_cli.planner.simulate import simulate, simulated_cost

REPO = Path(__file__).resolve().parents[2]


def test_split_state_bytes_moves_one_category_per_stage():
    assert [split_state_bytes("bf16", z) for z in range(4)] == [(16, 0), (4, 12), (2, 14),
                                                                (0, 16)]
    assert split_state_bytes("fp32", 1) == (8, 8)


@pytest.mark.parametrize(("zero", "expected"), [
    # (param, grad, optimizer) bytes of a rank holding 2 layers x 100 params, shared by 2 ranks;
    # ZeRO-3 also holds one gathered layer (100 x 2 B) while computing
    (0, (400, 400, 2400)),
    (1, (400, 400, 1200)),
    (2, (400, 200, 1200)),
    (3, (200 + 200, 200, 1200)),
])
def test_each_zero_stage_shards_its_categories_over_the_holders(zero, expected):
    a = metaop("t/enc", layers=2, batch=4, module="enc", params=100, stash=10)
    led = Ledger(graph([a]), 3, MemoryStrategy(zero=zero))
    led.commit(a, 0, 2, (0, 1), "dp")
    table = {m.rank: m for m in led.table()}
    for r in (0, 1):
        assert (table[r].param_bytes, table[r].grad_bytes, table[r].optimizer_bytes) == expected
        assert table[r].activation_bytes == 10 * 2 * 2  # 2 rows x 2 operators
        assert led.used()[r] == pytest.approx(table[r].total_bytes)
    assert table[2].total_bytes == 0


def test_a_new_holder_shrinks_the_shards_of_the_others():
    a = metaop("t1/enc", layers=2, batch=4, module="enc", params=300, stash=0)
    b = metaop("t2/enc", layers=2, batch=2, module="enc", params=300, stash=0)
    led = Ledger(graph([a, b]), 4, MemoryStrategy(zero=1))
    led.commit(a, 0, 2, (0, 1), "dp")
    before = led.used()[0]
    assert before == pytest.approx(2 * 300 * (4 + 12 / 2))
    led.commit(b, 0, 1, (2,), "dp")  # layer 0 now has 3 holders, layer 1 still 2
    table = {m.rank: m for m in led.table()}
    assert table[0].optimizer_bytes == round(300 * 12 / 3 + 300 * 12 / 2)
    assert table[2].optimizer_bytes == round(300 * 12 / 3)
    assert led.used()[0] == pytest.approx(table[0].total_bytes) and led.used()[0] < before
    assert led.used()[2] == pytest.approx(table[2].total_bytes)


def test_tensor_parallel_shards_split_over_the_data_parallel_copies():
    a = metaop("t/enc", layers=1, batch=4, module="enc", params=1000, stash=0)
    led = Ledger(graph([a]), 4, MemoryStrategy(zero=3))
    led.commit(a, 0, 1, (0, 1, 2, 3), "tp2")  # each rank holds 1/2, two copies
    # its quarter of the state plus the gathered half layer (500 params x 2 B)
    assert all(m.total_bytes == 1000 * 16 // 4 + 500 * 2 for m in led.table())
    assert layer_bytes_per_rank(a, 4, "tp2", "bf16", MemoryStrategy(zero=3)) == 1000 * 16 / 4


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("recompute", [False, True])
def test_need_never_underestimates_what_commit_adds(zero, recompute):
    rng = np.random.default_rng(zero * 2 + recompute)
    ops = [metaop(f"t{i}/enc", layers=6, batch=4, module="enc", params=500, stash=40,
                  act_bytes=64) for i in range(3)]
    led = Ledger(graph(ops), 8, MemoryStrategy(zero=zero, recompute=recompute))
    for _ in range(12):
        m = ops[int(rng.integers(3))]
        first = int(rng.integers(6))
        last = int(rng.integers(first + 1, 7))
        n = int(rng.choice([1, 2, 4]))
        ranks = tuple(sorted(rng.choice(8, size=n, replace=False).tolist()))
        bound = led.used() + led.need(m, first, last, n, "dp")
        led.commit(m, first, last, ranks, "dp")
        assert np.all(led.used()[list(ranks)] <= bound[list(ranks)] + 1e-6)
    totals = np.array([m.total_bytes for m in led.table()])
    assert np.allclose(led.used(), totals, atol=4)


def test_recompute_keeps_operator_inputs_and_one_operator_stash():
    # input 4096 B for a batch of 8 -> 512 B per sample instead of the 1000 B stash
    a = metaop("t/enc", layers=3, batch=8, module="enc", params=0, stash=1000, act_bytes=4096)
    assert kept_bytes_per_sample(a, recompute=False) == 1000
    assert kept_bytes_per_sample(a, recompute=True) == 512
    led = Ledger(graph([a]), 2, MemoryStrategy(recompute=True))
    led.commit(a, 0, 3, (0, 1), "dp")
    for m in led.table():
        assert m.activation_bytes == 512 * 4 * 3 + 1000 * 4  # inputs + one operator's stash


def test_memory_ladder_orders_settings_least_aggressive_first():
    assert memory_ladder() == ((0, False), (1, False), (2, False), (3, False),
                               (0, True), (1, True), (2, True), (3, True))
    assert memory_ladder("zero2", "auto") == ((2, False), (2, True))
    assert memory_ladder("auto", "off") == ((0, False), (1, False), (2, False), (3, False))
    assert memory_ladder("none", "on") == ((0, True),)
    with pytest.raises(ValueError):
        memory_ladder("zero4")


def test_options_record_memory_strategies_only_when_on():
    assert "zero" not in PlanOptions().as_dict() and "recompute" not in PlanOptions().as_dict()
    opts = PlanOptions(zero=2, recompute=True).as_dict()
    assert opts["zero"] == "2" and opts["recompute"] == "true"
    with pytest.raises(ValueError):
        PlanOptions(zero=5)


def _tight_case(memory_bytes):
    # 4 layers x 1000 params on 2 ranks: 64000 B replicated, 40000 B under ZeRO-1,
    # 36000 B under ZeRO-2, 32000 B + a 2000 B gathered layer under ZeRO-3; activations
    # 4 x 8 B x 1 row
    g = graph([metaop("t/a", layers=4, batch=2, params=1000, stash=8)])
    return g, profile([alpha_beta_curve("t/a", 2, 0.0, 1.0)]), cluster(per_node=2,
                                                                       memory_bytes=memory_bytes)


@pytest.mark.parametrize(("memory_bytes", "zero"), [(70_000, 0), (50_000, 1), (35_000, 3)])
def test_auto_picks_the_least_aggressive_setting_that_fits(memory_bytes, zero):
    g, p, c = _tight_case(memory_bytes)
    plan = make_fitting_plan(g, p, c, options=PlanOptions(planner="sequential"))
    assert plan.options.get("zero", "0") == str(zero) and "recompute" not in plan.options
    assert all(m.total_bytes <= memory_bytes for m in plan.memory)
    for less in range(zero):
        with pytest.raises(PlanInfeasible):
            make_plan(g, p, c, options=PlanOptions(planner="sequential", zero=less))


def test_auto_keeps_the_setting_that_simulates_fastest():
    # ZeRO-3 fits the tight case too, but its weight gathers make it slower than ZeRO-0
    # (ZeRO-1/2 simulate alike and lose the tie); recomputation only adds compute
    g, p, c = _tight_case(70_000)
    times = {}
    for zero, recompute in memory_ladder():
        trial = make_plan(g, p, c, options=PlanOptions(zero=zero, recompute=recompute))
        times[(zero, recompute)] = simulate(trial, g, p, c).iteration_ms
    assert times[(3, False)] > times[(0, False)] < times[(0, True)]
    plan = make_fitting_plan(g, p, c)
    assert simulate(plan, g, p, c).iteration_ms == pytest.approx(min(times.values()))
    assert "zero" not in plan.options and "recompute" not in plan.options


def _planned_settings(monkeypatch) -> list[tuple[int, bool, bool]]:
    """The (ZeRO stage, recompute, own) settings the memory search goes on to plan, in order;
    own: with Spindle's own candidates, not the baselines' schedules alone."""
    planned: list[tuple[int, bool, bool]] = []
    real = api.make_plan_with_cost

    def recorded(*args, **kwargs):
        options = kwargs["options"]
        planned.append((options.zero, options.recompute, kwargs.get("own", True)))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "make_plan_with_cost", recorded)
    return planned


def _stash_heavy(memory_bytes):
    # 4 layers x 1e8 params on 2 ranks, a large stash: without recomputation 14.4e9 B under
    # ZeRO-0, 11.4e9 B under ZeRO-3; with it 8.4e9 B under ZeRO-0, 6.0e9 B under ZeRO-1
    g = graph([metaop("t/a", layers=4, batch=2, params=10**8, stash=2 * 10**9,
                      act_bytes=64 * 10**5)])
    return g, profile([alpha_beta_curve("t/a", 2, 0.0, 1.0)]), cluster(per_node=2,
                                                                       memory_bytes=memory_bytes)


def _simulated_settings(g, p, c):
    """Each memory setting's plan made alone, by its simulated iteration (those that fit)."""
    times = {}
    for zero, recompute in memory_ladder():
        with contextlib.suppress(PlanInfeasible):
            trial = make_plan(g, p, c, options=PlanOptions(zero=zero, recompute=recompute))
            times[(zero, recompute)] = simulated_cost(trial, g, p, c).iteration_ms
    return times


def test_auto_leaves_recomputation_to_the_baselines_where_memory_limits_nothing(monkeypatch):
    # every setting fits, and the gradient sync makes every plan outlast recomputation's
    # compute, so no setting is skipped for its compute; memory limits nothing without
    # recomputation (with less memory a slice of one device holds fewer than its 4 operators),
    # so under it Spindle tries the baselines' schedules only
    g, p, c = _stash_heavy(300 * 10**8)
    tight: set[str] = set()
    make_plan_with_cost(*_stash_heavy(150 * 10**8), limited=tight)
    assert tight == {"slices"}
    limited: set[str] = set()
    make_plan_with_cost(g, p, c, limited=limited)
    assert not limited
    times = _simulated_settings(g, p, c)
    assert len(times) == 8
    fastest = min(times.values())
    assert compute_bound_ms(g, options_curves(g, p, c, PlanOptions(recompute=True)), 2) < fastest
    planned = _planned_settings(monkeypatch)
    _, iteration_ms = fitting_plan_with_cost(g, p, c)
    assert planned == [(*setting, not setting[1]) for setting in memory_ladder()]
    assert iteration_ms == pytest.approx(fastest)
    # asked for, it gets Spindle's own candidates
    planned.clear()
    make_fitting_plan(g, p, c, ladder=memory_ladder("auto", "on"))
    assert planned == [(*setting, True) for setting in memory_ladder("auto", "on")]


def test_auto_tries_recomputation_where_a_setting_without_it_does_not_fit(monkeypatch):
    # without recomputation only ZeRO-3 fits, and its weight gathers make it slower than
    # ZeRO-1 with recomputation
    g, p, c = _stash_heavy(115 * 10**8)
    times = _simulated_settings(g, p, c)
    assert [setting for setting in times if not setting[1]] == [(3, False)]
    fastest = min(times.values())
    assert times[(3, False)] > fastest == times[(1, True)]
    planned = _planned_settings(monkeypatch)
    plan, iteration_ms = fitting_plan_with_cost(g, p, c)
    assert planned == [(*setting, True) for setting in memory_ladder()]
    assert iteration_ms == pytest.approx(fastest)
    assert plan.options["zero"] == "1" and plan.options["recompute"] == "true"


def test_auto_tries_recomputation_where_memory_limits_a_setting_that_fits(monkeypatch):
    # a review's case: OFASys' image and video captioning on 2 nodes of 6 GPUs of 11.1 GiB,
    # --memory none. ZeRO-0 fits, but its faster candidates run out of memory; with
    # recomputation Spindle's own plan simulates 80.3 ms, the baselines' schedules 88.3
    spec = load(str(REPO / "models" / "ofasys.yaml"), ModelSpec)
    c = load(str(REPO / "benchmarks" / "sweep" / "clusters" / "2x6.yaml"), ClusterSpec)
    c = replace(c, device=replace(c.device, memory_bytes=11_928_899_584))
    g = as_written(build_graph(spec, tasks=["image_caption", "video_caption"]))
    p = profile_for(g, c)
    ladder = memory_ladder("none", "auto")
    limited: set[str] = set()
    make_plan_with_cost(g, p, c, options=PlanOptions(), limited=limited)
    assert "candidates" in limited
    planned = _planned_settings(monkeypatch)
    plan, iteration_ms = fitting_plan_with_cost(g, p, c, ladder=ladder)
    assert planned == [(0, False, True), (0, True, True)]
    assert plan.options.get("recompute") == "true" and "'s schedule" not in plan.candidate
    baselines_ms = make_plan_with_cost(g, p, c, options=PlanOptions(recompute=True),
                                       own=False)[1]
    assert iteration_ms < baselines_ms


def test_auto_fails_with_the_last_settings_error():
    g, p, c = _tight_case(1000)
    with pytest.raises(OutOfMemory, match="out of memory placing"):
        make_fitting_plan(g, p, c)


def test_recompute_costs_one_extra_forward():
    g = graph([metaop("t/a", layers=4, batch=2, params=10, stash=8)])
    p = profile([alpha_beta_curve("t/a", 2, 0.5, 1.0)])
    plain = make_plan(g, p, cluster(per_node=2), options=PlanOptions(planner="sequential"))
    again = make_plan(g, p, cluster(per_node=2),
                      options=PlanOptions(planner="sequential", recompute=True))
    assert again.options["recompute"] == "true"
    assert again.estimated_iteration_ms == pytest.approx(plain.estimated_iteration_ms * 4 / 3)
    assert [s.time_ms * 4 / 3 for _, s in plain.slices()] == \
        pytest.approx([s.time_ms for _, s in again.slices()])


def test_a_flat_module_too_big_for_one_device_gets_spare_devices():
    # a/embed's curve is flat, so the allocator gives it one device, where its state does not
    # fit (16 bytes per parameter, 14.9 GiB of a 10-GiB device, under any ZeRO stage); on the
    # level's spare devices ZeRO-1 shards its optimizer state (4 + 12 / n bytes) and it fits.
    # One task: no task-stable candidate gives it a task's group either
    g, p = flat_and_steep(embed_params=10**9, enc="a/enc")
    c = cluster(per_node=8, memory_bytes=10 * GIB)
    plan = make_plan(g, p, c, options=PlanOptions(zero=1))
    assert min(len(s.ranks) for _, s in plan.slices() if s.metaop == "a/embed") >= 2
    assert all(m.total_bytes <= c.device.memory_bytes for m in plan.memory)


def test_a_mixed_bound_candidate_that_does_not_fit_is_tried_spread(monkeypatch):
    # the embedding (flat, 0.5 B parameters: 7.5 GiB of state on its one device under ZeRO-1)
    # fits beside a/big's layers while a/big stays inside a node (bound 4), not when a/big
    # spans both nodes (bound 8: the first candidate, out of memory). The kept bound 4 with
    # a/big's level under bound 8 has the same waves as that first candidate, so it is not
    # assembled again; it is retried from the spread allocation, where ZeRO-1 shards the
    # embedding's optimizer state over the spare devices, and that fits
    assembled: list[tuple[str, bool]] = []
    assemble = search.assemble

    def recorded(*args, **kwargs):
        try:
            plan = assemble(*args, **kwargs)
        except PlanInfeasible:
            assembled.append((kwargs["candidate"], False))
            raise
        assembled.append((kwargs["candidate"], True))
        return plan

    monkeypatch.setattr(search, "assemble", recorded)
    g = graph([metaop("a/embed", layers=1, batch=8, params=5 * 10**8),
               metaop("a/enc", layers=1, batch=8),
               metaop("a/big", level=1, layers=16, batch=8, preds=("a/embed", "a/enc"),
                      params=5 * 10**7)])
    p = profile([alpha_beta_curve("a/embed", 8, 1.0, 1e-5),
                 alpha_beta_curve("a/enc", 8, 0.0, 0.1), alpha_beta_curve("a/big", 8, 0.0, 1.0)])
    c = cluster(num_nodes=2, per_node=4, memory_bytes=10 * GIB)
    api.make_plan(g, p, c, options=PlanOptions(zero=1))
    assert assembled[:2] == [("level by level, device bound 8", False),
                             ("level by level, device bound 4", True)]
    assert ("level by level, device bound 4/8, spare devices spread", True) in assembled


QWEN = [("qwen-val", "qwen-val-a800-8x8", "a800-4x8", planner) for planner in PLANNERS] + [
    # on 64 GPUs Spindle fits without ZeRO (at 72.8 of 74 GiB): its allocator leaves each
    # text embedding, whose curve is flat, on one device instead of the level's spare ones
    ("qwen-val", "qwen-val-a800-8x8", "a800-8x8", planner)
    for planner in PLANNERS if planner != "spindle"]


@pytest.mark.parametrize(("model", "prof", "clus", "planner"), QWEN)
def test_qwen_val_fits_with_memory_strategies_in_every_planner(model, prof, clus, planner):
    g = load(str(REPO / "graphs" / f"{model}.yaml"), MetaOpGraph)
    p = load(str(REPO / "profiles" / f"{prof}.yaml"), Profile)
    c = load(str(REPO / "clusters" / f"{clus}.yaml"), ClusterSpec)
    with pytest.raises(PlanInfeasible, match="out of memory"):
        make_plan(g, p, c, options=PlanOptions(planner=planner))
    plan = make_fitting_plan(g, p, c, options=PlanOptions(planner=planner))
    assert int(plan.options["zero"]) >= 1
    assert all(m.total_bytes <= c.device.memory_bytes for m in plan.memory)


def test_the_memory_search_skips_no_setting_a_fused_plan_would_win():
    # Batch 4 caps every MetaOp at 4 of 8 devices: level by level each level idles half the
    # cluster, the fused plan runs a/head beside b/enc, in less compute than the levels' sum
    # of C*. A setting must not be skipped for that sum being above the best iteration.
    ms = [metaop("a/enc", layers=1, batch=4, params=10**6),
          metaop("b/enc", layers=8, batch=4, params=10**6, module="benc"),
          metaop("a/head", level=1, layers=8, batch=4, preds=("a/enc",), params=10**6)]
    p = replace(profile([alpha_beta_curve("a/enc", 4, 0.0, 0.01),
                         alpha_beta_curve("b/enc", 4, 0.0, 1.0),
                         alpha_beta_curve("a/head", 4, 0.0, 1.0)]),
                optimizer=OptimizerCost(ms_per_tensor=0.0, ms_per_million_params=0.5))
    g, c = graph(ms), cluster(num_nodes=1, per_node=8)
    ladder = memory_ladder("auto", "off")
    each = {}
    for zero, recompute in ladder:
        options = PlanOptions(zero=zero, recompute=recompute)
        plan = make_plan(g, p, c, options=options)
        assert plan.estimated_iteration_ms < plan.lower_bound_ms
        assert compute_bound_ms(g, options_curves(g, p, c, options), 8) <= (
            plan.estimated_iteration_ms)
        each[zero] = simulated_cost(plan, g, p, c).iteration_ms
    plan, iteration_ms = fitting_plan_with_cost(g, p, c, ladder=ladder)
    assert iteration_ms == pytest.approx(min(each.values()))
    assert each[int(plan.options["zero"])] == pytest.approx(min(each.values()))
    assert min(each.values()) < each[0]


@pytest.mark.parametrize("name", ["qwen-val-a800-4x8", "qwen-val-a800-8x8",
                                  "qwen-val-30b-a800-32x8", "qwen-val-70b-a800-32x8"])
def test_committed_qwen_plans_fit_their_devices(name):
    plan = load(str(REPO / "plans" / f"{name}.yaml"), Plan)
    c = load(str(REPO / "clusters" / f"{plan.cluster}.yaml"), ClusterSpec)
    assert all(m.total_bytes <= c.device.memory_bytes for m in plan.memory)


def test_tensor_parallel_ranks_keep_their_share_of_the_stash():
    # Megatron without sequence parallelism keeps 10/34 of a layer's activations replicated
    # and splits the rest: a tp2 rank keeps 10/34 + 24/68 = 22/34 of 340 B = 220 B per row
    a = metaop("t/enc", layers=1, batch=2, module="enc", params=0, stash=340, act_bytes=64)
    led = Ledger(graph([a]), 2)
    led.commit(a, 0, 1, (0, 1), "tp2")
    assert [m.activation_bytes for m in led.table()] == [220 * 2, 220 * 2]
    # recomputation keeps the whole (replicated) input: 64 B / 2 samples = 32 B per row
    led = Ledger(graph([a]), 2, MemoryStrategy(recompute=True))
    led.commit(a, 0, 1, (0, 1), "tp2")
    assert [m.activation_bytes for m in led.table()] == [32 * 2 + 220 * 2] * 2


def test_a_rank_running_two_shards_of_a_layer_holds_both():
    a = metaop("t1/enc", layers=4, batch=4, module="enc", params=1000, stash=0)
    b = metaop("t2/enc", layers=4, batch=4, module="enc", params=1000, stash=0)
    led = Ledger(graph([a, b]), 4)
    assert not led.commit(a, 0, 4, (0, 1), "tp2").any()
    # rank 1 held shard 1 of 2; as the first rank of (1, 2) it now runs shard 0 too
    beyond = led.commit(b, 0, 2, (1, 2), "tp2")
    assert beyond.tolist() == [True, False]
    params = [m.param_bytes for m in led.table()]
    # 2 B per weight: rank 1 the whole of layers 0-1 and half of 2-3, the others half
    assert params == [4 * 500 * 2, (2 * 1000 + 2 * 500) * 2, 2 * 500 * 2, 0]
    assert led.used()[1] == pytest.approx(led.table()[1].total_bytes)


def test_nested_shards_add_nothing_and_crossing_ones_add_their_union():
    a = metaop("t1/enc", layers=1, batch=4, module="enc", params=800, stash=0)
    b = metaop("t2/enc", layers=1, batch=4, module="enc", params=800, stash=0)
    c = metaop("t3/enc", layers=1, batch=4, module="enc", params=800, stash=0)
    led = Ledger(graph([a, b, c]), 8)
    led.commit(a, 0, 1, (0, 1, 2, 3), "tp4")  # rank r: shard r of 4 (the eighths j = r mod 4)
    # shard 0 of 2 on rank 0 holds its shard 0 of 4; shard 1 of 2 on rank 1 its shard 1 of 4
    assert not led.commit(b, 0, 1, (0, 1), "tp2").any()
    # on (1, 2): rank 1 adds shard 0 of 2 to its shard 1 of 2, the whole layer; rank 2 adds
    # shard 1 of 2 (j odd) to its shard 2 of 4 (j = 2 mod 4), 3/4 of it
    beyond = led.commit(c, 0, 1, (1, 2), "tp2")
    assert beyond.tolist() == [True, True]
    params = [m.param_bytes for m in led.table()]
    assert params[:4] == [400 * 2, 800 * 2, 600 * 2, 200 * 2]
    # data parallel afterwards: the whole layer, nothing beyond the largest share
    assert not led.commit(a, 0, 1, (2, 5), "dp").any()
    assert [m.param_bytes for m in led.table()][2] == 800 * 2


def test_shards_of_any_degrees_are_refined_to_their_common_multiple():
    ops = [metaop(f"t{i}/enc", layers=1, batch=420, module="enc", params=420, stash=0)
           for i in range(3)]
    led = Ledger(graph(ops), 16)
    led.commit(ops[0], 0, 1, tuple(range(7)), "tp7")
    led.commit(ops[1], 0, 1, tuple(range(5)), "tp5")  # 35 finer shards
    assert led.commit(ops[1], 0, 1, (1, 2, 3, 4, 5), "tp5")[0]  # rank 1: shard 0 of 5 too
    # 105 finer shards: rank 4 holds j = 4 mod 7, 4 mod 5, 3 mod 5 and now 0 mod 3
    assert led.commit(ops[2], 0, 1, (4, 5, 6), "tp3")[0]
    held = {j for j in range(105) if j % 7 == 4 or j % 5 in (3, 4) or j % 3 == 0}
    assert led.table()[4].param_bytes == round(len(held) / 105 * 420 * 2)
