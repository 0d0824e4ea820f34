"""Piecewise alpha-beta fitting (planner/curves.py) as the planner sees it through
planner/scaling.py: exact on piecewise-linear data, monotone, invertible, never negative."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spindle_cli.artifacts.profile import Curve, MemoryModel, ProfilePoint
from spindle_cli.planner import scaling
from spindle_cli.planner.curves import Sample, fit_curve, fit_pieces, monotone

MEMORY = MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0, activation_bytes_per_sample=0)
COUNTS = (1, 2, 4, 8, 16, 32, 64)


def _curve(samples: list[Sample], batch: int, heldout: tuple[Sample, ...] = ()) -> Curve:
    points = tuple(
        ProfilePoint(num_devices=s.num_devices, strategy=s.strategy, feasible=True,
                     time_ms=s.time_ms, peak_memory_bytes=0)
        for s in samples
    )
    return fit_curve(signature="sig", batch_size=batch, samples=samples, points=points,
                     memory=MEMORY, heldout=heldout, validated=bool(heldout))


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


@settings(max_examples=60, deadline=None)
@given(
    batch=st.sampled_from([64, 128, 256, 1000]),
    floor=st.floats(0.01, 5.0),
    slopes=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6),
)
def test_fit_is_exact_on_piecewise_linear_data(batch, floor, slopes):
    truth, values = _piecewise_truth(batch, floor, slopes)
    curve = _curve(_samples(values), batch)
    assert curve.max_rel_error < 1e-9
    for n in [1, 1.5, 2, 3, 5.5, 8, 12, 20, 33, 48, 64]:
        assert scaling.time_ms(curve, n) == pytest.approx(truth(n), rel=1e-9)


@settings(max_examples=80, deadline=None)
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


@settings(max_examples=60, deadline=None)
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


def test_a_slower_larger_count_takes_the_running_minimum_but_stays_raw():
    times = [10.0, 6.0, 7.0, 4.0]
    samples = _samples(times, (1, 2, 4, 8))
    assert [s.time_ms for s in monotone(samples)] == [10.0, 6.0, 6.0, 4.0]
    curve = _curve(samples, 8)
    assert [p.time_ms for p in curve.points] == times
    assert scaling.time_ms(curve, 4) == pytest.approx(6.0)
    assert curve.max_rel_error == pytest.approx(1 / 7)
    assert all(p.beta_ms >= 0 for p in curve.pieces)


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


def test_heldout_error_is_measured_off_the_fit():
    samples = _samples([8.0, 4.0, 2.0], (1, 2, 4))
    heldout = (Sample(num_devices=3, time_ms=2.0, strategy="dp"),)
    curve = _curve(samples, 12, heldout)
    # on perfect scaling the fit predicts T(3) = 8 / 3; the held-out point is faster
    assert curve.heldout_rel_error == pytest.approx((8 / 3 - 2.0) / 2.0)
    assert _curve(samples, 12).heldout_rel_error is None


def test_no_samples_or_duplicates_are_rejected():
    with pytest.raises(ValueError, match="without a feasible sample"):
        fit_pieces([], 8)
    with pytest.raises(ValueError, match="duplicate"):
        fit_pieces(_samples([2.0, 1.0], (2, 2)), 8)
