"""Wavefront scheduling (Algorithm 1): propose, extend, align, remainders, merge."""

from __future__ import annotations

import pytest
from plan_builders import alpha_beta_curve, graph, metaop, profile
from test_allocation import worked_example

from spindle_cli.planner.alignment import PlannedWave, Slot, align, merge_or_append
from spindle_cli.planner.allocation import AslTuple, LevelAllocation, OpAllocation
from spindle_cli.planner.refinement import best_schedule, refine_level
from spindle_cli.planner.schedules import allocate, op_curves, spindle_waves
from spindle_cli.planner.shortening import shorten_waves
from spindle_cli.planner.waves import (
    ROUNDINGS,
    SORT_RULES,
    VARIANTS,
    schedule_level,
    wavefront_level,
    without_extension,
)


def test_align_matches_the_papers_wave_two():
    # MetaOps 1, 2, 4 offer 9, 14 and 3 operators; MetaOp 4's tuple is the shortest, so the
    # wave lasts its 3 operators and MetaOps 1 and 2 run 1 and 2 operators (8 and 13 remain)
    assert align([2.5, 1.4, 1.0], [9, 14, 3]) == [1, 2, 3]


def test_align_runs_the_shortest_tuple_completely():
    ops = align([1.0, 3.0, 0.7], [4, 10, 50])
    assert ops[0] == 4
    # t_min = 4; k = round(4 / 3) = 1 and round(4 / 0.7) = 6, so the span is 6 * 0.7 = 4.2;
    # then floor(4.2 / 3) = 1 and floor(4.2 / 0.7) = 6
    assert ops == [4, 1, 6]


def test_merge_folds_a_repeating_wave_into_the_previous_one():
    w1 = PlannedWave(level=0, slots=(Slot(metaop="a/x", n=2, num_ops=3, op_time_ms=1.0),
                                     Slot(metaop="b/y", n=2, num_ops=1, op_time_ms=2.0)))
    w2 = PlannedWave(level=0, slots=(Slot(metaop="b/y", n=2, num_ops=2, op_time_ms=2.0),))
    waves = [w1]
    merge_or_append(waves, w2)
    assert len(waves) == 1
    assert [(s.metaop, s.num_ops) for s in waves[0].slots] == [("a/x", 3), ("b/y", 3)]
    w3 = PlannedWave(level=0, slots=(Slot(metaop="b/y", n=1, num_ops=1, op_time_ms=3.0),))
    merge_or_append(waves, w3)  # another n: a new wave
    assert len(waves) == 2
    w4 = PlannedWave(level=1, slots=(Slot(metaop="b/y", n=1, num_ops=1, op_time_ms=3.0),))
    merge_or_append(waves, w4)  # never across levels
    assert len(waves) == 3


def test_worked_example_waves():
    g, p = worked_example()
    curves = op_curves(g, p, 4)
    waves = spindle_waves(g, curves, allocate(g, curves, 4), 4)
    got = [[(s.metaop, s.n, s.num_ops) for s in w.slots] for w in waves]
    # wave 0: the two 2-device tuples; aligned to MetaOp 2's 8 operators on 2 devices
    assert got[0] == [("a/m1", 2, 4), ("b/m2", 2, 8)]
    # wave 1: MetaOp 1's remainder keeps n = 2; MetaOps 3 and 2's lower tuple take 1 each
    assert got[1] == [("a/m1", 2, 4), ("c/m3", 1, 5), ("b/m2", 1, 3)]
    # wave 2: two devices would idle, so both remainders are extended to 2 devices
    assert got[2] == [("b/m2", 2, 1), ("c/m3", 2, 1)]
    for w in waves:
        assert sum(s.n for s in w.slots) <= 4
        assert w.duration_ms == max(s.time_ms for s in w.slots)


def big_and_small():
    """A level of 8 operators and 1 operator, each allocated 2 of 8 devices: its curves and
    allocation."""
    g = graph([metaop("a/big", layers=8, batch=8), metaop("b/small", layers=1, batch=8)])
    p = profile([alpha_beta_curve("a/big", 8, 0.0, 1.0), alpha_beta_curve("b/small", 8, 0.0, 1.0)])
    alloc = LevelAllocation(level=0, c_star_ms=1.0, lower_bound_ms=1.0, ops=(
        OpAllocation(metaop="a/big", n_star=2, n_lo=2, n_hi=2, ops_lo=0, ops_hi=8,
                     tuples=(AslTuple(metaop="a/big", n=2, num_ops=8),)),
        OpAllocation(metaop="b/small", n_star=2, n_lo=2, n_hi=2, ops_lo=0, ops_hi=1,
                     tuples=(AslTuple(metaop="b/small", n=2, num_ops=1),)),
    ))
    return op_curves(g, p, 8), alloc


def test_extension_gives_idle_devices_to_the_longest_remaining_work():
    curves, alloc = big_and_small()
    waves = schedule_level(alloc, curves, 8, {"a/big": (), "b/small": ()}, set())
    first = {s.metaop: s.n for s in waves[0].slots}
    # 4 devices idle after proposing 2 + 2: a/big has the most remaining time and goes to 4;
    # it cannot reach 8 with the 2 left, so b/small takes them
    assert first == {"a/big": 4, "b/small": 4}
    # the remainder of a/big comes back with its original n = 2, then is extended again
    assert sum(s.num_ops for w in waves for s in w.slots if s.metaop == "a/big") == 8


def test_extension_counts_the_pending_tuples_of_a_metaop():
    """'remaining': a MetaOp's remaining time includes its tuples still pending. a/x runs 2
    operators on 4 devices now (6 ms) and has 6 more pending on 2 (36 ms); b/y runs 4 on 2
    (24 ms): the 2 idle devices go to a/x (4 -> 6). Counting this wave's tuples only
    ('scheduled') gives them to b/y (a test review's mutation that dropped the pending
    tuples from 'remaining' survived every test of this file)."""
    g = graph([metaop("a/x", layers=8, batch=12), metaop("b/y", layers=4, batch=12)])
    p = profile([alpha_beta_curve("a/x", 12, 0.0, 1.0), alpha_beta_curve("b/y", 12, 0.0, 1.0)])
    curves = op_curves(g, p, 8)
    alloc = LevelAllocation(level=0, c_star_ms=1.0, lower_bound_ms=1.0, ops=(
        OpAllocation(metaop="a/x", n_star=3, n_lo=2, n_hi=4, ops_lo=6, ops_hi=2,
                     tuples=(AslTuple(metaop="a/x", n=4, num_ops=2),
                             AslTuple(metaop="a/x", n=2, num_ops=6))),
        OpAllocation(metaop="b/y", n_star=2, n_lo=2, n_hi=2, ops_lo=0, ops_hi=4,
                     tuples=(AslTuple(metaop="b/y", n=2, num_ops=4),)),
    ))
    first = {rule: {s.metaop: s.n for s in wavefront_level(
        alloc, curves, 8, {"a/x": (), "b/y": ()}, set(), extension=rule)[0].slots}
        for rule in ("remaining", "scheduled")}
    assert first == {"remaining": {"a/x": 6, "b/y": 2}, "scheduled": {"a/x": 4, "b/y": 4}}


def test_extension_spends_no_devices_on_a_flat_curve():
    # b/small's curve is flat (0.01% faster on 8 devices than on 2): in the same level the
    # devices a/big cannot use stay idle instead of syncing b/small's gradients over 6 ranks
    _, alloc = big_and_small()
    flat = profile([alpha_beta_curve("a/big", 8, 0.0, 1.0),
                    alpha_beta_curve("b/small", 8, 1.0, 1e-5)])
    g = graph([metaop("a/big", layers=8, batch=8), metaop("b/small", layers=1, batch=8)])
    curves = op_curves(g, flat, 8)
    assert curves["b/small"].faster_count(2) is None
    assert curves["a/big"].faster_count(2) == 4
    waves = schedule_level(alloc, curves, 8, {"a/big": (), "b/small": ()}, set())
    assert {s.metaop: s.n for s in waves[0].slots} == {"a/big": 4, "b/small": 2}


def test_without_extension_idle_devices_stay_idle():
    curves, alloc = big_and_small()
    waves = schedule_level(alloc, curves, 8, {"a/big": (), "b/small": ()}, set(),
                           extension="none")
    # the same level as in the extension test, but the 4 idle devices stay idle: every
    # MetaOp keeps its 2 devices, so its rows never move between its own slices
    assert {(s.metaop, s.n) for w in waves for s in w.slots} == {("a/big", 2), ("b/small", 2)}
    assert sum(s.num_ops for w in waves for s in w.slots if s.metaop == "a/big") == 8
    assert all(sum(s.n for s in w.slots) <= 4 for w in waves)
    assert without_extension(VARIANTS) == tuple(
        (rule, rounding, "none") for rule in SORT_RULES for rounding in ROUNDINGS)


def test_successors_wait_for_their_predecessors():
    g = graph([metaop("t/a", layers=2, batch=4), metaop("t/b", layers=3, batch=4),
               metaop("t/c", level=1, layers=2, batch=4, preds=("t/a", "t/b"))])
    p = profile([alpha_beta_curve(s, 4, 0.1, 1.0) for s in ("t/a", "t/b", "t/c")])
    curves = op_curves(g, p, 4)
    waves = spindle_waves(g, curves, allocate(g, curves, 4), 4)
    last_pred = max(i for i, w in enumerate(waves) for s in w.slots if s.metaop in ("t/a", "t/b"))
    first_c = min(i for i, w in enumerate(waves) for s in w.slots if s.metaop == "t/c")
    assert first_c > last_pred
    assert [w.level for w in waves] == sorted(w.level for w in waves)


def test_exact_packing_of_tuples():
    from spindle_cli.planner.exact import exact_packing_ms

    # two 2-device tuples side by side, then the 4-device one
    assert exact_packing_ms([("a", 2, 10.0), ("b", 2, 10.0), ("c", 4, 5.0)], 4) == \
        pytest.approx(15.0)
    # 3 + 2 devices cannot run together on 4
    assert exact_packing_ms([("a", 3, 10.0), ("b", 2, 10.0)], 4) == pytest.approx(20.0)
    # two tuples of one MetaOp never overlap, even with devices to spare
    assert exact_packing_ms([("a", 2, 10.0), ("a", 2, 10.0)], 4) == pytest.approx(20.0)
    # four 1-device jobs on 2 devices: 4 + 2 | 3 + 3
    assert exact_packing_ms([("a", 1, 4.0), ("b", 1, 3.0), ("c", 1, 3.0), ("d", 1, 2.0)], 2) == \
        pytest.approx(6.0)


TINY_CLIP_LEVEL = [("a/audio", 1, 2.951), ("a/text", 1, 2.703), ("b/text", 1, 3.0),
                   ("b/vision", 1, 4.427), ("c/text", 1, 3.0), ("c/vision", 1, 2.686),
                   ("d/audio", 1, 3.0), ("d/vision", 1, 4.427)]
"""tiny-clip's encoder level on two CPU ranks (plans/tiny-clip-local-cpu-2.yaml): one device
per tuple, a partition the MILP does not prove optimal in 10 s."""


def test_exact_packing_answers_without_a_solver_where_its_bound_is_the_optimum(monkeypatch):
    from spindle_cli.planner import exact

    def no_solver(*args, **kwargs):
        raise AssertionError("solved where the bound is the optimum")

    monkeypatch.setattr(exact, "milp", no_solver)
    # every tuple fits beside the others: each MetaOp's tuples in sequence
    assert exact.exact_packing([("a", 1, 4.0), ("a", 1, 3.0), ("b", 2, 5.0)], 4) == \
        exact.Packing(7.0, 7.0)
    # no two fit side by side (one device: the 11-second MILP explain ran before)
    assert exact.exact_packing([("a", 1, 4.0), ("b", 1, 3.0)], 1) == exact.Packing(7.0, 7.0)
    assert exact.exact_packing([("a", 3, 4.0), ("b", 3, 3.0)], 4) == exact.Packing(7.0, 7.0)


def test_an_unproven_packing_reports_what_was_found_and_the_bound():
    from spindle_cli.planner.exact import exact_packing, exact_packing_ms

    packing = exact_packing(TINY_CLIP_LEVEL, 2, time_limit_s=0.5)
    assert packing is not None and not packing.proven
    area = sum(t for _, _, t in TINY_CLIP_LEVEL) / 2
    assert area - 1e-9 <= packing.bound_ms < packing.found_ms <= 1.01 * area
    assert exact_packing_ms(TINY_CLIP_LEVEL, 2, time_limit_s=0.5) is None


def test_a_signal_stops_the_exact_packing_before_its_time_limit():
    """HiGHS runs on a thread: a signal is handled at once (Ctrl-C or SIGTERM stopped
    `spindle explain` only when the solver gave up, 10 s later)."""
    import signal
    import time

    from spindle_cli.planner.exact import exact_packing

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    before = signal.signal(signal.SIGALRM, stop)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Stopped):
            exact_packing(TINY_CLIP_LEVEL, 2, time_limit_s=4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert time.monotonic() - t0 < 3


def test_the_exact_packing_of_the_rounded_tuples_is_at_least_c_star():
    from spindle_cli.planner.exact import exact_packing_ms

    g, p = worked_example()
    curves = op_curves(g, p, 4)
    [level] = allocate(g, curves, 4)
    tuples = [(t.metaop, t.n, t.num_ops * curves[t.metaop].time_at(t.n))
              for a in level.ops for t in a.tuples]
    best = exact_packing_ms(tuples, 4)
    assert best is not None
    assert level.c_star_ms <= best + 1e-6


def test_max_ops_splits_a_tuple_over_waves_and_blocks_merging():
    g = graph([metaop("a/big", layers=6, batch=4)])
    p = profile([alpha_beta_curve("a/big", 4, 0.0, 1.0)])
    curves = op_curves(g, p, 4)
    [level] = allocate(g, curves, 4)
    waves = schedule_level(level, curves, 4, {"a/big": ()}, set(), max_ops=lambda m, n: 2)
    assert [[(s.metaop, s.n, s.num_ops) for s in w.slots] for w in waves] == [
        [("a/big", 4, 2)], [("a/big", 4, 2)], [("a/big", 4, 2)]]


def _two_metaops():
    # T0(n) = 0.32 + 0.88 / n and T1(n) = 0.44 + 5.76 / n on B = 8 (valid counts 1, 2, 4, 8);
    # the allocator gives t0/m 1 device (2 ops, 2.4 ms) and t1/m 8 devices (2 ops, 2.32 ms),
    # 9 devices in all, so on 8 devices the two cannot run side by side
    g = graph([metaop("t0/m", layers=2, batch=8), metaop("t1/m", layers=2, batch=8)])
    p = profile([alpha_beta_curve("t0/m", 8, 0.32, 0.11), alpha_beta_curve("t1/m", 8, 0.44, 0.72)])
    curves = op_curves(g, p, 8)
    [level] = allocate(g, curves, 8)
    return curves, level


def test_refine_level_finds_a_rounding_that_packs_better():
    curves, level = _two_metaops()
    assert [[(t.n, t.num_ops) for t in x.tuples] for x in level.ops] == [[(1, 2)], [(8, 2)]]
    preds: dict[str, tuple[str, ...]] = {"t0/m": (), "t1/m": ()}
    plain, _ = best_schedule(level, curves, 8, preds, set(), VARIANTS)
    finished: set[str] = set()
    kept, waves = refine_level(level, curves, 8, preds, finished, VARIANTS)
    # one of t1/m's operators moves down to 4 devices: it runs alone on 8 (1.16 ms), then on
    # 4 next to t0/m, extended to the 4 idle devices (max(1.88, 2 * 0.54) = 1.88 ms)
    assert [[(t.n, t.num_ops) for t in x.tuples] for x in kept.ops] == [[(1, 2)], [(8, 1), (4, 1)]]
    assert sum(w.duration_ms for w in waves) == pytest.approx(1.16 + 1.88)
    assert sum(w.duration_ms for w in waves) < sum(w.duration_ms for w in plain) - 0.1
    assert finished == {"t0/m", "t1/m"}
    for w in waves:
        assert sum(s.n for s in w.slots) <= 8


def test_refine_level_keeps_the_plain_schedule_when_no_rounding_helps():
    g, p = worked_example()
    curves = op_curves(g, p, 4)
    [level] = allocate(g, curves, 4)
    preds: dict[str, tuple[str, ...]] = {m.id: () for m in g.metaops}
    plain, _ = best_schedule(level, curves, 4, preds, set(), VARIANTS)
    kept, waves = refine_level(level, curves, 4, preds, set(), VARIANTS, max_runs=len(VARIANTS))
    # a budget of one run per variant leaves no trial: the allocator's rounding stays
    assert kept == level
    assert [w.slots for w in waves] == [w.slots for w in plain]
    _, refined = refine_level(level, curves, 4, preds, set(), VARIANTS)
    assert sum(w.duration_ms for w in refined) <= sum(w.duration_ms for w in plain) + 1e-9


def test_refine_level_trials_keep_every_operator_on_valid_counts():
    curves, level = _two_metaops()
    preds: dict[str, tuple[str, ...]] = {"t0/m": (), "t1/m": ()}
    kept, waves = refine_level(level, curves, 8, preds, set(), VARIANTS)
    for x in kept.ops:
        oc = curves[x.metaop]
        assert sum(t.num_ops for t in x.tuples) == oc.metaop.num_layers
        assert all(t.n in oc.counts[1:] and t.num_ops > 0 for t in x.tuples)
    ran = {}
    for w in waves:
        for s in w.slots:
            ran[s.metaop] = ran.get(s.metaop, 0) + s.num_ops
    assert ran == {"t0/m": 2, "t1/m": 2}


def _wave(level, *slots):
    return PlannedWave(level=level, slots=tuple(
        Slot(metaop=m, n=n, num_ops=k, op_time_ms=t) for m, n, k, t in slots))


def test_shorten_waves_moves_operators_out_of_a_tied_wave():
    # A and B both bound the first wave (2 ms): moving one operator of each is needed to
    # shorten it, which a single-slot move cannot see; A's goes to the second wave, where B's
    # slot already sets 2 ms, so the level drops from 2 + 2 to 1 + 2 ms
    waves = [_wave(1, ("a/x", 2, 2, 1.0), ("b/y", 4, 1, 1.0)),
             _wave(1, ("a/x", 2, 1, 1.0), ("b/y", 4, 2, 1.0))]
    new = shorten_waves(waves)
    assert [[(s.metaop, s.n, s.num_ops) for s in w.slots] for w in new] == [
        [("a/x", 2, 1), ("b/y", 4, 1)], [("a/x", 2, 2), ("b/y", 4, 2)]]
    assert sum(w.duration_ms for w in new) == pytest.approx(3.0)
    # with at most one operator per slice nothing may move, and the waves stay as they are
    assert shorten_waves(waves, lambda m, n: 1) == waves


def test_shorten_waves_drops_emptied_slots_and_waves():
    # b/y's single operator in the second wave fits next to its first slot's slack
    waves = [_wave(0, ("a/x", 2, 4, 1.0), ("b/y", 2, 1, 1.0)),
             _wave(0, ("b/y", 2, 1, 1.0))]
    new = shorten_waves(waves)
    assert [[(s.metaop, s.num_ops) for s in w.slots] for w in new] == [[("a/x", 4), ("b/y", 2)]]


def _two_orders_of_equal_length():
    """a/x: 8 operators of 1 ms on 1 device (B = 1); b/y: one 1 ms operator on 4 devices. Each
    runs in a wave of its own (b/y leaves no device for a/x; next to a/x, b/y does not fit),
    so largest n first and largest area first both take 1 + 8 ms, in opposite orders."""
    g = graph([metaop("a/x", layers=8, batch=1), metaop("b/y", layers=1, batch=4)])
    p = profile([alpha_beta_curve("a/x", 1, 0.0, 1.0), alpha_beta_curve("b/y", 4, 0.0, 1.0)])
    curves = op_curves(g, p, 4)
    alloc = LevelAllocation(level=0, c_star_ms=8.0, lower_bound_ms=8.0, ops=(
        OpAllocation(metaop="a/x", n_star=1, n_lo=1, n_hi=1, ops_lo=0, ops_hi=8,
                     tuples=(AslTuple(metaop="a/x", n=1, num_ops=8),)),
        OpAllocation(metaop="b/y", n_star=4, n_lo=4, n_hi=4, ops_lo=0, ops_hi=1,
                     tuples=(AslTuple(metaop="b/y", n=4, num_ops=1),)),
    ))
    return alloc, curves


def test_big_area_rule_proposes_the_largest_device_time_first():
    # a/x: 8 device-ms on its only valid count; b/y: 4 device-ms. Largest n first admits b/y
    # alone (no device left for a/x); largest area first admits a/x, and b/y no longer fits
    # next to it
    alloc, curves = _two_orders_of_equal_length()
    preds: dict[str, tuple[str, ...]] = {"a/x": (), "b/y": ()}
    first = {rule: [s.metaop for s in schedule_level(alloc, curves, 4, preds, set(),
                                                    sort_rule=rule)[0].slots]
             for rule in ("bigN_bigT", "bigT", "bigA")}
    # longest time first: a/x's 8 ms before b/y's 1 ms, as largest area first
    assert first == {"bigN_bigT": ["b/y"], "bigT": ["a/x"], "bigA": ["a/x"]}


def test_down_rounding_keeps_the_span_at_the_shortest_tuple():
    # t_min = 3 x 1.0 ms = 3 ms; the other tuple's operators take 0.8 ms, 3 / 0.8 = 3.75 of them.
    # 'nearest' takes 4 (a 3.2 ms span, into which the first tuple still fits only its 3);
    # 'down' takes 3 (2.4 ms), so the span stays 3 ms, and then floor(3 / 0.8) = 3 fit
    assert align([1.0, 0.8], [3, 10], rounding="nearest") == [3, 4]
    assert align([1.0, 0.8], [3, 10], rounding="down") == [3, 3]
    # 'down' still gives a tuple at least one operator, longer than t_min or not
    assert align([1.0, 5.0], [2, 10], rounding="down") == [2, 1]


def test_best_schedule_keeps_the_first_variant_on_ties():
    alloc, curves = _two_orders_of_equal_length()
    preds: dict[str, tuple[str, ...]] = {"a/x": (), "b/y": ()}
    by_n = ("bigN_bigT", "nearest", "remaining")
    by_area = ("bigA", "nearest", "remaining")
    for variants, first in (((by_n, by_area), "b/y"), ((by_area, by_n), "a/x")):
        waves, ranking = best_schedule(alloc, curves, 4, preds, set(), variants)
        assert [s.metaop for s in waves[0].slots] == [first]
        assert sum(w.duration_ms for w in waves) == pytest.approx(9.0)
        # a tie keeps the variants' own order
        assert ranking == variants
