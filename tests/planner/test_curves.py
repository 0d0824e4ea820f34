"""Piecewise alpha-beta fitting (planner/curves.py) as the planner sees it through
planner/scaling.py: exact on piecewise-linear data, ends at the last count that helps, breaks
at roofline kinks, invertible, never negative."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples

from spindle_cli.artifacts.profile import Curve, MemoryModel, ProfilePoint
from spindle_cli.planner import scaling
from spindle_cli.planner.curves import Sample, fit_curve, fit_pieces, helpful_run
from spindle_cli.planner.profiling import work_devices

MEMORY = MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0, activation_bytes_per_sample=0)
COUNTS = (1, 2, 4, 8, 16, 32, 64)


def _curve(samples: list[Sample], batch: int) -> Curve:
    points = tuple(
        ProfilePoint(num_devices=s.num_devices, strategy=s.strategy, feasible=True,
                     time_ms=s.time_ms, peak_memory_bytes=0)
        for s in samples
    )
    return fit_curve(signature="sig", batch_size=batch, samples=samples, points=points,
                     memory=MEMORY)


def _samples(times: list[float], counts: tuple[int, ...] = COUNTS) -> list[Sample]:
    return [Sample(num_devices=n, time_ms=t, strategy="dp") for n, t in zip(counts, times,
                                                                              strict=True)]


def _piecewise_truth(batch: int, floor: float, slopes: list[float]):
    """A continuous function of b = B / n, linear between the profiled counts, with
    non-negative slopes (so non-increasing in n) and value `floor` at n = 64."""
    knots_b = [batch / n for n in COUNTS]
    values = [floor]
    for i in range(len(COUNTS) - 1, 0, -1):
        values.insert(0, values[0] + slopes[i - 1] * (knots_b[i - 1] - knots_b[i]))

    def at(n: float) -> float:
        b = batch / n
        for i in range(len(COUNTS) - 1):
            if knots_b[i + 1] <= b <= knots_b[i]:
                w = (b - knots_b[i + 1]) / (knots_b[i] - knots_b[i + 1])
                return values[i + 1] + w * (values[i] - values[i + 1])
        raise AssertionError(n)

    return at, values


@settings(max_examples=examples(60), deadline=None)
@given(
    batch=st.sampled_from([64, 128, 256, 1000]),
    floor=st.floats(0.01, 5.0),
    slopes=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6),
)
def test_fit_is_exact_on_piecewise_linear_data(batch, floor, slopes):
    truth, values = _piecewise_truth(batch, floor, slopes)
    curve = _curve(_samples(values), batch)
    assert curve.max_rel_error < 1e-9
    for n in COUNTS:
        assert scaling.time_ms(curve, n) == pytest.approx(truth(n), rel=1e-9)
    # between the counts too, unless three slopes fall in a row (then the fit reads a
    # roofline kink into the middle segment, which this data does not have)
    kinks = any(a > b > c for a, b, c in zip(slopes, slopes[1:], slopes[2:], strict=False))
    if not kinks:
        for n in [1.5, 3, 5.5, 12, 20, 33, 48]:
            assert scaling.time_ms(curve, n) == pytest.approx(truth(n), rel=1e-9)


@settings(max_examples=examples(80), deadline=None)
@given(times=st.lists(st.floats(0.001, 1e4), min_size=7, max_size=7),
       batch=st.sampled_from([8, 64, 96, 512]))
def test_any_data_gives_a_positive_non_increasing_curve(times, batch):
    curve = _curve(_samples(times), batch)
    assert all(p.beta_ms >= 0 for p in curve.pieces)
    grid = [1 + i * 0.25 for i in range(0, 4 * 200)]
    values = [scaling.time_ms(curve, n) for n in grid]
    assert all(v > 0 for v in values)
    assert all(a >= b - 1e-9 * a for a, b in zip(values, values[1:], strict=False))
    assert scaling.floor_ms(curve) >= 0
    for i in range(1, len(curve.pieces)):
        assert curve.pieces[i].n_lo == curve.pieces[i - 1].n_hi


@settings(max_examples=examples(60), deadline=None)
@given(times=st.lists(st.floats(0.01, 1e3), min_size=7, max_size=7),
       frac=st.floats(0.0, 1.0), later=st.sampled_from(["dp", "tp2"]))
def test_inverse_n_undoes_time_ms(times, frac, later):
    batch = 256
    # tensor parallel from 2 devices on adds a zero-width dp head piece at n = 1, and a
    # superlinear last segment adds a zero-width tail piece
    samples = [Sample(num_devices=s.num_devices, time_ms=s.time_ms,
                      strategy="dp" if s.num_devices == 1 else later)
               for s in _samples(sorted(times, reverse=True))]
    curve = _curve(samples, batch)
    t_hi, t_lo = scaling.time_ms(curve, 1), scaling.time_ms(curve, 64)
    t = t_lo + frac * (t_hi - t_lo)
    n = scaling.inverse_n(curve, t)
    if t_hi == t_lo:
        assert scaling.time_ms(curve, n) <= t * (1 + 1e-9)
        return
    assert 0 < n <= 64 + 1e-9
    assert scaling.time_ms(curve, n) <= t * (1 + 1e-9)
    # n is the smallest such count: a little less is slower (unless T is flat there)
    if n > 1.001:
        assert scaling.time_ms(curve, n * 0.999) >= t * (1 - 1e-9)


def test_inverse_of_a_profiled_count_is_that_count():
    curve = _curve(_samples([100.0, 52.0, 28.0, 16.0, 10.0, 7.0, 5.5]), 128)
    for n in COUNTS[1:]:
        assert scaling.inverse_n(curve, scaling.time_ms(curve, n)) == pytest.approx(n)
    assert scaling.inverse_n(curve, 0.5 * scaling.floor_ms(curve)) == math.inf


def test_the_curve_ends_before_the_first_slower_count_and_keeps_it_raw():
    times = [10.0, 6.0, 7.0, 4.0]
    samples = _samples(times, (1, 2, 4, 8))
    assert [s.num_devices for s in helpful_run(samples)] == [1, 2]
    curve = _curve(samples, 8)
    assert [p.time_ms for p in curve.points] == times
    assert curve.pieces[-1].n_hi == 2
    assert scaling.count_range(curve) == (1, 2)
    assert scaling.valid_counts(curve, 8) == [1, 2]
    # exact at every count it covers: no running minimum hides the slower 4
    assert curve.max_rel_error == pytest.approx(0.0, abs=1e-12)


def test_equal_times_still_help():
    # a loss whose work does not split: the same time at every count is not slower
    samples = _samples([3.0, 3.0, 3.0], (1, 2, 4))
    curve = _curve(samples, 8)
    assert scaling.count_range(curve) == (1, math.inf)
    assert scaling.time_ms(curve, 4) == pytest.approx(3.0)


def test_a_curve_fitted_on_one_count_is_not_used_below_it():
    # one point has no slope: its flat piece would say one device runs as fast as eight
    curve = _curve(_samples([5.0], (8,)), 64)
    assert scaling.count_range(curve) == (8, math.inf)
    assert scaling.valid_counts(curve, 16) == [8, 16]
    # one count that does not divide the batch: 48 devices on 64 rows run 2 rows each, the
    # work of 32, so its flat piece covers 32-48; it extends no lower either
    one = Sample(num_devices=48, time_ms=5.0, strategy="dp", work_devices=32.0)
    curve = _curve([one], 64)
    assert (curve.pieces[0].n_lo, curve.pieces[-1].n_hi) == (32, 48)
    assert scaling.count_range(curve) == (32, math.inf)
    assert scaling.valid_counts(curve, 64) == [32, 64]
    # 32 and 48 devices both run 2 rows: two counts, one work, still no slope
    curve = _curve([Sample(num_devices=32, time_ms=5.0, strategy="dp"), one], 64)
    assert scaling.count_range(curve) == (32, math.inf)
    # two points give a slope, which extends down as the alpha-beta line
    curve = _curve(_samples([5.0, 3.0], (8, 16)), 64)
    assert scaling.count_range(curve) == (1, math.inf)
    assert scaling.time_ms(curve, 4) == pytest.approx(9.0)


def test_a_piece_claiming_a_strategy_its_points_cannot_run_is_read_without_them():
    # a hand-edited profile: the first piece (1-2 devices) says tp2, though its point on one
    # device ran data parallel. That point is left out of the slope test (reading it as tp2
    # divided by zero groups); the other points' slope leaves the range open below, and
    # one device is no valid count under tp2
    curve = _curve(_samples([10.0, 6.0, 4.0], (1, 2, 4)), 8)
    first = dataclasses.replace(curve.pieces[0], strategy="tp2")
    edited = dataclasses.replace(curve, pieces=(first, *curve.pieces[1:]))
    assert scaling.count_range(edited) == (1, math.inf)
    assert scaling.valid_counts(edited, 8) == [2, 4, 8]


def test_a_roofline_kink_inside_a_segment_is_placed_where_the_lines_meet():
    # T(b) = max(0.5 + 0.1 b, 0.2 b) + 0.05 with b = B / n: memory-bound below b = 5,
    # compute-bound above; B = 40 puts the kink at n = 8, between the profiled 4 and 16.
    batch = 40

    def truth(n: float) -> float:
        b = batch / n
        return max(0.5 + 0.1 * b, 0.2 * b) + 0.05

    counts = (1, 2, 4, 16, 32, 40)
    curve = _curve([Sample(num_devices=n, time_ms=truth(n), strategy="dp") for n in counts],
                   batch)
    assert 8 in {p.n_hi for p in curve.pieces}
    for n in range(1, 41):
        assert scaling.time_ms(curve, n) == pytest.approx(truth(n), rel=1e-9), n
    # the chord from 4 to 16 alone would overestimate T(8)
    chord = _curve([Sample(num_devices=n, time_ms=truth(n), strategy="dp") for n in (4, 16)],
                   batch)
    assert scaling.time_ms(chord, 8) > truth(8) * 1.05


def test_a_kink_between_whole_counts_is_bridged_continuously():
    batch = 36  # kink at b = 5, n = 7.2: pieces break at 7 and 8

    def truth(n: float) -> float:
        b = batch / n
        return max(0.5 + 0.1 * b, 0.2 * b)

    counts = (1, 2, 4, 12, 18, 36)
    curve = _curve([Sample(num_devices=n, time_ms=truth(n), strategy="dp") for n in counts],
                   batch)
    assert {7, 8} <= {p.n_hi for p in curve.pieces}
    for n in range(1, 37):
        assert scaling.time_ms(curve, n) == pytest.approx(truth(n), rel=1e-9), n
    grid = [4 + i / 100 for i in range(801)]
    values = [scaling.time_ms(curve, n) for n in grid]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_kink_across_a_strategy_switch():
    samples = [Sample(num_devices=n, time_ms=t, strategy=s) for n, t, s in
               [(1, 10.0, "dp"), (2, 5.5, "dp"), (4, 3.5, "tp2"), (8, 2.8, "tp2"),
                (16, 2.6, "tp2")]]
    pieces = fit_pieces(samples, 16)
    assert [p.n_hi for p in pieces] == [2, 4, 8, 16]


def test_a_count_that_does_not_split_the_batch_sits_at_its_work():
    # B = 96 on 64 devices: 2 samples per device, the work of 48 devices
    samples = [Sample(num_devices=32, time_ms=3.0, strategy="dp"),
               Sample(num_devices=64, time_ms=2.0, strategy="dp", work_devices=48.0)]
    curve = _curve(samples, 96)
    assert scaling.time_ms(curve, 48) == pytest.approx(2.0)
    assert scaling.time_ms(curve, 56) == pytest.approx(2.0)
    assert scaling.time_ms(curve, 64) == pytest.approx(2.0)
    assert curve.max_rel_error == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("batch", "counts"), [(80, (1, 2, 4, 8, 16, 32, 64)),
                                                (64, (1, 3, 5, 7, 9))])
def test_a_count_whose_work_is_no_whole_count_sits_at_its_work(batch, counts):
    # B = 80 on 32 devices runs 3 rows each, the work of 26.67 devices; placed at b = B / 32
    # with the time of 3 rows, the line read 20 devices (4 rows) 2.6% slow and 28-39 up to
    # 5.9%, while the fit error said 0. A time linear in the rows per device is read exactly
    # at every count, where the planner reads it (`work_count`)
    def truth(n: int) -> float:
        return 0.5 + 0.25 * math.ceil(batch / n)

    samples = [Sample(num_devices=n, time_ms=truth(n), strategy="dp",
                      work_devices=0.0 if batch % n == 0 else batch / math.ceil(batch / n))
               for n in counts]
    curve = _curve(samples, batch)
    for n in range(1, counts[-1] + 1):
        assert scaling.time_ms(curve, scaling.work_count(curve, n)) == pytest.approx(truth(n))
    assert curve.max_rel_error == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("batch", "points"), [
    (100, [(10, 2.0), (11, 2.0), (12, 1.9)]),  # 11's work is 10 up to float noise
    (13, [(2, 20.0), (4, 3.0)]),  # a steep drop to a count whose work is just below it
    (200, [(26, 8.3376), (89, 3.8496)]),  # 89's work, 66.67, far below it
    (96, [(5, 9.0), (7, 6.0), (11, 4.0), (13, 3.5)]),
])
def test_counts_placed_at_their_work_keep_the_curve_whole_and_never_rising(batch, points):
    # a first placement of fractional works divided by zero (a) or went negative at a count
    # (b), rose by a step past the placed knot (c), and read one device at 20 ms of 7 rows (b)
    samples = [Sample(num_devices=n, time_ms=t, strategy="dp",
                      work_devices=work_devices(batch, n, "dp")) for n, t in points]
    curve = _curve(samples, batch)
    times = [scaling.time_ms(curve, n) for n in range(1, points[-1][0] + 1)]
    assert all(t > 0 for t in times)
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(times))
    for s in samples:  # exact at every fitted count
        assert scaling.time_ms(curve, s.num_devices) == pytest.approx(s.time_ms)


def test_first_count_keeps_its_own_strategy():
    samples = [Sample(num_devices=1, time_ms=10.0, strategy="dp"),
               Sample(num_devices=2, time_ms=6.0, strategy="tp2"),
               Sample(num_devices=4, time_ms=3.5, strategy="tp2")]
    curve = _curve(samples, 4)
    assert scaling.strategy(curve, 1) == "dp"
    assert scaling.strategy(curve, 2) == "tp2"
    assert scaling.time_ms(curve, 1) == pytest.approx(10.0)
    assert scaling.is_valid(curve, 1) and scaling.is_valid(curve, 2)
    assert not scaling.is_valid(curve, 3)


def test_superlinear_last_segment_extrapolates_linearly_not_negative():
    # 8 -> 16 devices more than halves the time: the straight line in b crosses zero.
    samples = _samples([80.0, 40.0, 20.0, 10.0, 2.0], (1, 2, 4, 8, 16))
    pieces = fit_pieces(samples, 16)
    assert pieces[-1].alpha_ms == 0.0
    curve = _curve(samples, 16)
    assert scaling.time_ms(curve, 16) == pytest.approx(2.0)
    assert scaling.time_ms(curve, 1000) == pytest.approx(2.0 * 16 / 1000)
    inside = 10.0 - 8.0 * (1 / 8 - 1 / 12) / (1 / 8 - 1 / 16)  # on the 8..16 line in 1 / n
    assert scaling.time_ms(curve, 12) == pytest.approx(inside)


def test_one_count_gives_a_flat_curve():
    curve = _curve(_samples([3.0], (4,)), 16)
    assert scaling.time_ms(curve, 4) == 3.0
    assert scaling.time_ms(curve, 64) == 3.0
    assert scaling.floor_ms(curve) == 3.0


def test_no_samples_or_duplicates_are_rejected():
    with pytest.raises(ValueError, match="without a feasible sample"):
        fit_pieces([], 8)
    with pytest.raises(ValueError, match="duplicate"):
        fit_pieces(_samples([2.0, 1.0], (2, 2)), 8)


def test_measured_noise_keeps_a_count_within_the_tolerance_flat_and_reports_its_error():
    # 4 devices are 5% slower than 2, within a 10% tolerance; 8 are 30% slower: the end
    samples = _samples([10.0, 6.0, 6.3, 7.8], (1, 2, 4, 8))
    assert [s.num_devices for s in helpful_run(samples)] == [1, 2]
    assert [s.num_devices for s in helpful_run(samples, 0.10)] == [1, 2, 4]
    points = tuple(ProfilePoint(num_devices=s.num_devices, strategy="dp", feasible=True,
                                time_ms=s.time_ms, peak_memory_bytes=0) for s in samples)
    curve = fit_curve(signature="sig", batch_size=8, samples=samples, points=points,
                      memory=MEMORY, noise_rel=0.10)
    assert scaling.count_range(curve) == (1, 4)
    # no speedup claimed past 2, none of the noise's slowdown either
    assert scaling.time_ms(curve, 4) == pytest.approx(6.0)
    assert scaling.time_ms(curve, 2) == pytest.approx(6.0)
    assert curve.max_rel_error == pytest.approx(0.3 / 6.3)


def test_noise_tolerance_compares_with_the_best_earlier_count_not_the_previous_one():
    # each step 8% slower than the one before: within 10% of its predecessor, not of the best
    samples = _samples([10.0, 5.0, 5.4, 5.83], (1, 2, 4, 8))
    assert [s.num_devices for s in helpful_run(samples, 0.10)] == [1, 2, 4]
    pieces = fit_pieces(samples, 8, noise_rel=0.10)
    assert pieces[-1].n_hi == 4
    assert all(p.beta_ms >= 0 for p in pieces)


def test_alpha_is_the_fixed_cost_of_the_piece_holding_n():
    # T(n) = 0.3 + 8 / n up to 8 devices, then flat at T(8): alpha 0.3 on the alpha-beta
    # pieces, T(8) = 1.3 once nothing more scales (the floor beyond the last piece too).
    c = _curve(_samples([0.3 + 8 / n if n <= 8 else 1.3 for n in COUNTS]), batch=64)
    assert [scaling.alpha_ms(c, n) for n in (1, 2, 4, 8)] == pytest.approx([0.3] * 4)
    assert scaling.alpha_ms(c, 128) == pytest.approx(scaling.floor_ms(c))
    assert scaling.floor_ms(c) == pytest.approx(1.3)
