"""`spindle diff`'s semantic difference (`views.plan_diff.differences`) on hand-edited copies
of a golden plan: each edit a reviewer cares about is named, and none that is not there."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from spindle_cli.artifacts import Plan, load
from spindle_cli.cli.views.plan_diff import differences
from spindle_cli.units import fmt_bytes

PLAN = (Path(__file__).resolve().parents[1] / "data" / "plan-two-node-multitask"
        / "expected_plan.yaml")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return load(PLAN, Plan)


def with_slice(plan: Plan, wave: int, index: int, **changes: object) -> Plan:
    """`plan` with slice `index` of wave `wave` changed."""
    w = plan.waves[wave]
    slices = tuple(replace(s, **changes) if i == index else s for i, s in enumerate(w.slices))
    return replace(plan, waves=tuple(replace(x, slices=slices) if x is w else x
                                     for x in plan.waves))


def test_the_same_plan_has_no_differences(plan):
    assert differences(plan, replace(plan)) == []


def test_a_slice_on_another_strategy_is_named(plan):
    # t1/txt on ranks 4-7 as two tensor-parallel pairs instead of data parallel, at the same
    # estimated time: the operators and device counts are the same, the slice is not
    b = with_slice(plan, 0, 1, strategy="tp2")
    assert differences(plan, b) == ["allocation t1/txt: [0:4)@4 -> [0:4)@4(tp2)",
                                    "waves with other slices: 0"]


def test_memory_moved_between_categories_at_the_same_total_is_named(plan):
    # rank 0 holds 1000 bytes more parameters and 1000 fewer of activations
    m = plan.memory[0]
    b = replace(plan, memory=(replace(m, param_bytes=m.param_bytes + 1000,
                                      activation_bytes=m.activation_bytes - 1000),
                              *plan.memory[1:]))
    assert differences(plan, b) == ["memory changed on 1 rank(s) (0): params, activations"]


def test_transfer_bytes_that_changed_are_not_called_moved(plan):
    # the first transfer (ranks 0-3 to the same ranks) carries twice its bytes
    t = plan.transfers[0]
    b = replace(plan, transfers=(replace(t, bytes=2 * t.bytes), *plan.transfers[1:]))
    assert differences(plan, b) == [
        "transfers: 7 -> 7; bytes 20.0 MiB -> 28.0 MiB (+8.0 MiB), between different ranks "
        "2.0 MiB -> 2.0 MiB (+0 B)"]


def test_parameter_group_bytes_that_changed_are_not_called_moved(plan):
    g = plan.param_groups[0]
    b = replace(plan, param_groups=(replace(g, bytes=g.bytes + 8000), *plan.param_groups[1:]))
    assert differences(plan, b) == [
        "parameter groups: 4 -> 4; bytes 25.4 KiB -> 33.2 KiB (+7.8 KiB)"]


def test_renumbered_levels_are_listed(plan):
    b = replace(plan, levels=(*plan.levels[:2], replace(plan.levels[2], level=3)))
    assert differences(plan, b) == ["levels: 0, 1, 2 -> 0, 1, 3"]


def test_a_slice_order_within_a_wave_is_not_a_move(plan):
    # wave 0's two slices listed the other way round (ids and transfers renamed alike): the
    # same slices on the same ranks
    w = plan.waves[0]
    first, second = w.slices
    ids = {first.id: second.id, second.id: first.id}
    b = replace(plan, waves=(replace(w, slices=(replace(second, id=first.id),
                                                replace(first, id=second.id))),
                             *plan.waves[1:]),
                transfers=tuple(replace(t, src=ids.get(t.src, t.src), dst=ids.get(t.dst, t.dst))
                                for t in plan.transfers))
    assert not any(line.startswith("placement") for line in differences(plan, b))


def test_an_option_spelled_at_its_default_is_the_same_plan(plan):
    # a missing key means the default (Plan.options): 'zero: 0' and no 'zero' are one plan
    spelled = replace(plan, options={**plan.options, "zero": "0", "recompute": "false",
                                     "tensor_parallel": "true"})
    assert differences(plan, spelled) == []
    zero2 = replace(plan, options={**plan.options, "zero": "2"})
    assert differences(plan, zero2) == ["option zero: 0 -> 2"]


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda p: with_slice(p, 1, 0, time_ms=2.0),
     ["slice estimates: 1 slice(s) with other times: w1.0 t2/txt 1.800 -> 2.000 ms"]),
    (lambda p: replace(p, waves=(p.waves[0], replace(p.waves[1], start_ms=12.0),
                                 *p.waves[2:])),
     ["wave estimates: 1 wave(s) starting at another time"]),
    (lambda p: replace(p, waves=(p.waves[0], replace(p.waves[1], duration_ms=12.0),
                                 replace(p.waves[2], start_ms=p.waves[2].start_ms + 0.5),
                                 *p.waves[3:])),
     ["wave estimates: 1 wave(s) with another duration: wave 1 2.200 -> 12.000 ms; 1 wave(s) "
      "starting at another time"]),
    (lambda p: replace(p, waves=(p.waves[0], replace(p.waves[1], level=1), *p.waves[2:])),
     ["wave levels: wave 1 0 -> 1"]),
    (lambda p: replace(p, islands=(tuple(range(8)),)), ["islands: [0-3] [4-7] -> [0-7]"]),
])
def test_estimates_wave_levels_and_islands_are_named(plan, edit, expected):
    assert differences(plan, edit(plan)) == expected


def test_an_iteration_from_no_time_has_no_relative_change(plan):
    # no percentage of zero, rather than a '+0.0%' that reads as no change
    b = replace(plan, estimated_iteration_ms=0.0)
    assert differences(b, plan) == ["estimated compute: 0.000 -> 26.300 ms (+26.300 ms)"]


def test_memory_names_the_ranks_and_the_biggest_change(plan):
    # which ranks, and by how much the one that changed most did: rank 2's activations grow
    # by 1 MiB, rank 3's by 1 KiB
    bumped = {2: 2**20, 3: 2**10}
    b = replace(plan, memory=tuple(replace(m, activation_bytes=m.activation_bytes
                                           + bumped.get(m.rank, 0)) for m in plan.memory))
    total = plan.memory[2].total_bytes
    assert differences(plan, b)[-1] == (
        "memory changed on 2 rank(s) (2-3): activations; the most on rank 2: "
        f"{fmt_bytes(total)} -> {fmt_bytes(total + 2**20)} (+1.0 MiB)")


def test_memory_compares_the_ranks_both_plans_have():
    """A rank only one plan has is no memory change to 0 B (tiny-clip on 4 ranks against 2:
    'the most on rank 3: 1.9 MiB -> 0 B'); the device count has its own line."""
    repo = Path(__file__).resolve().parents[2]
    a, b = (load(repo / "plans" / f"tiny-clip-local-cpu{s}.yaml", Plan) for s in ("", "-2"))
    lines = differences(a, b)
    assert f"num_devices: {a.num_devices} -> {b.num_devices}" in lines
    (memory,) = [line for line in lines if line.startswith("memory changed")]
    assert memory.startswith(f"memory changed on {b.num_devices} rank(s) of the "
                             f"{b.num_devices} both plans have (0-{b.num_devices - 1}): ")
    assert " -> 0 B" not in memory


def test_an_iteration_change_below_the_printed_digits_is_shown(plan):
    # +0.0004 ms printed as '+0.000 ms' and still made the plans differ
    b = replace(plan, estimated_iteration_ms=plan.estimated_iteration_ms + 0.0004)
    (line,) = differences(plan, b)
    assert line == (f"estimated compute: {plan.estimated_iteration_ms:.4f} -> "
                    f"{b.estimated_iteration_ms:.4f} ms (+0.0004 ms, +0.0%)")


def test_a_c_star_change_below_the_printed_digits_is_shown(plan):
    a, b = (replace(plan, lower_bound_ms=ms) for ms in (24.5901, 24.5904))
    assert differences(a, b) == ["C*: 24.5901 -> 24.5904 ms"]
