"""Evaluating a fitted scaling curve: T(n), its inverse, and the valid device counts.

A curve is piecewise alpha-beta in the per-device work b = B / n:
T(n) = alpha_k + beta_k * B / n on piece k = [n_lo, n_hi]. Below the first piece the first
piece extends (n < 1 is only used by the continuous relaxation); beyond the last piece the last
piece extends, so alpha of the last piece is the n -> infinity floor.
"""

from __future__ import annotations

import math

from spindle_cli.artifacts.profile import Curve, CurvePiece, tp_degree


def _piece(curve: Curve, n: float) -> CurvePiece:
    for p in curve.pieces:
        if n <= p.n_hi:
            return p
    return curve.pieces[-1]


def time_ms(curve: Curve, n: float) -> float:
    """Per-operator forward+backward time on n devices (n > 0, may be fractional)."""
    if n <= 0:
        raise ValueError(f"device count must be positive, got {n}")
    p = _piece(curve, n)
    return p.alpha_ms + p.beta_ms * curve.batch_size / n


def alpha_ms(curve: Curve, n: float) -> float:
    """The fixed per-operator cost at n devices (alpha of the piece holding n)."""
    return _piece(curve, n).alpha_ms


def strategy(curve: Curve, n: int) -> str:
    """The parallel strategy the curve uses at n devices."""
    return _piece(curve, n).strategy


def floor_ms(curve: Curve) -> float:
    """T(infinity): the alpha of the last piece."""
    return curve.pieces[-1].alpha_ms


def inverse_n(curve: Curve, t_ms: float) -> float:
    """The smallest (continuous) n with T(n) <= t_ms; infinity when t_ms is at or below the
    floor. Closed form per piece: n = beta * B / (t - alpha)."""
    B = curve.batch_size
    for p in curve.pieces:
        if time_ms(curve, p.n_hi) <= t_ms:
            lo = 0.0 if p is curve.pieces[0] else float(p.n_lo)
            if p.beta_ms == 0 or t_ms <= p.alpha_ms:
                return max(lo, 1e-9)
            n = p.beta_ms * B / (t_ms - p.alpha_ms)
            return min(max(n, lo), float(p.n_hi))
    last = curve.pieces[-1]
    if t_ms <= last.alpha_ms or last.beta_ms == 0:
        return math.inf
    return last.beta_ms * B / (t_ms - last.alpha_ms)


def count_range(curve: Curve) -> tuple[int, float]:
    """The device counts a curve may be used at, (lowest, highest), inclusive. The fitted pieces
    end where profiling found no feasible strategy (out of memory, timed out, fewer samples than
    data-parallel groups) or where the next profiled count is slower than the best earlier one
    beyond the timing noise tolerance (`curves.helpful_run`): a
    profiled point outside the pieces marks that side as closed. A side without such a point
    stays open: the first piece extends down, the last piece up; except below a curve fitted
    on one count (`--counts 8`), whose flat piece would claim that one device runs as fast as
    eight: no slope was seen to extend. What gives a slope is two different works per device,
    not two counts: 48 devices on a batch of 64 run 2 rows each, the work of 32 (the piece
    covers 32-48), so a curve fitted on 48 alone, or on 32 and 48, saw none."""
    lo, hi = curve.pieces[0].n_lo, curve.pieces[-1].n_hi
    profiled = [p.num_devices for p in curve.points]
    low = lo if any(c < lo for c in profiled) or not _slope_seen(curve, lo, hi) else 1
    high: float = hi if any(c > hi for c in profiled) else math.inf
    return low, high


def _slope_seen(curve: Curve, lo: int, hi: int) -> bool:
    """Whether the feasible points on the pieces [lo, hi] ran two different works per device
    (`work_count`); a point the strategy of its piece cannot run (tp4 on 2 devices, in a
    hand-edited profile) shows none."""
    seen = None
    for p in curve.points:
        if (p.feasible and lo <= p.num_devices <= hi
                and p.num_devices % tp_degree(strategy(curve, p.num_devices)) == 0):
            work = work_count(curve, p.num_devices)
            if seen is not None and work != seen:
                return True
            seen = work
    return False


def work_count(curve: Curve, n: int) -> float:
    """The (fractional) count whose B / n is the per-device batch n devices really run:
    n * (B / groups) / ceil(B / groups) with groups = n / t; n itself when the groups divide B.
    The planner reads an uneven split's time here (`allocation.op_time_ms`)."""
    groups = n // tp_degree(strategy(curve, n))
    return n * (curve.batch_size / groups) / math.ceil(curve.batch_size / groups)


def is_valid(curve: Curve, n: int, *, uneven: bool = False) -> bool:
    """Whether n devices is a practical allocation: n inside `count_range`; data parallel needs
    n | B (any n <= B with `uneven`); tensor parallel of degree t needs t | n and (n / t) | B
    (n / t <= B with `uneven`). An uneven split is read off the curve at its `work_count`, so
    that count must lie on a piece of the same strategy: otherwise the curve gives another
    strategy's time for it (B = 32 on tp2 x 24 groups runs 2 rows per group, the work of 32
    devices, where the curve holds data parallelism's time), and the slower real strategy
    would not help over the smaller count anyway."""
    low, high = count_range(curve)
    if n < max(1, low) or n > high:
        return False
    t = tp_degree(strategy(curve, n))
    if n % t:
        return False
    groups = n // t
    if not uneven:
        return curve.batch_size % groups == 0
    if groups > curve.batch_size:
        return False
    return strategy(curve, work_count(curve, n)) == strategy(curve, n)


def valid_counts(curve: Curve, max_n: int, *, uneven: bool = False) -> list[int]:
    """Valid device counts 1..max_n, ascending."""
    return [n for n in range(1, max_n + 1) if is_valid(curve, n, uneven=uneven)]
