"""Resource allocation per MetaLevel (paper §3.3): the relaxed optimum C* and the bi-point split.

Every MetaOp m of a level gets the continuous device count n*_m at which all MetaOps finish
together at C*, with sum n*_m = N (Theorem 1, eqs. 8-9). C* is found by bisection on the
speedup curve linearly interpolated between *valid* device counts (the public code's `n_lin`
form), which makes the two-point split below conserve the level's device-time area N * C*
exactly. Where C* is the time of a MetaOp that more devices barely speed up, the devices the
others leave over would all go to it; it gets the fewest that finish by C* instead, and the
area is then not all used (`allocate_level`; `spread=True` keeps the paper's). Each n*_m is
then replaced by two ASL-tuples on the nearest valid counts n_lo <= n* <= n_hi (n_lo = 0 is
a dummy), split in time as
    t_hi = (n* - n_lo) / (n_hi - n_lo) * C*,  t_lo = C* - t_hi,
    l_hi = t_hi / T(n_hi),                    l_lo = t_lo / T(n_lo),
and the operator counts are rounded to integers that still sum to L_m.

`allocate_level_analytic` is the paper's own form (n* from the fitted curve's inverse, tuples
from eqs. 10a-b); the planner does not use it, benchmarks/bench_planner.py compares the two
forms (which packs better depends on the level).

What does not live here: ordering tuples into waves (`waves.py`) and ranks (`placement.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from spindle_cli.artifacts.graph import MetaOp
from spindle_cli.artifacts.profile import Curve, tp_degree
from spindle_cli.planner import scaling

_BISECTION_STEPS = 200
_REL_TOL = 1e-12

MIN_GAIN = 1e-3
"""A larger count that runs less than this share faster buys no time: the wave scheduler's
extension does not spend devices on it, nor does the allocator unless asked to spread them
(`allocate_level`; a nearly flat curve, like a text embedding's lookups at 0.2308 ms per
operator on 1 device and 0.2308 on 8, took every device its level left over, and on 8 ranks
across two nodes its gradient sync ran 7 ms after the backward)."""


def op_time_ms(curve: Curve, n: int, *, uneven: bool = False) -> float:
    """Per-operator time on n devices. With uneven splits the slowest device has
    ceil(B / groups) rows, so the time is the curve's at that per-device batch."""
    if not uneven or _even(curve, n):
        return scaling.time_ms(curve, n)
    groups = n // tp_degree(scaling.strategy(curve, n))
    rows = -(-curve.batch_size // groups)
    return scaling.time_ms(curve, curve.batch_size * n / (rows * groups))


def valid_counts(curve: Curve, max_n: int, *, uneven: bool = False) -> list[int]:
    """`scaling.valid_counts`, without testing every n: a valid n is t * g with t the
    tensor-parallel degree of some piece and g | B (g <= B with uneven splits), so only those
    candidates go through `scaling.is_valid` (4096-device clusters have few divisors of B)."""
    b = curve.batch_size
    groups = range(1, min(b, max_n) + 1) if uneven else [g for g in range(1, min(b, max_n) + 1)
                                                          if b % g == 0]
    degrees = {tp_degree(p.strategy) for p in curve.pieces}
    candidates = sorted({t * g for t in degrees for g in groups if t * g <= max_n})
    return [n for n in candidates if scaling.is_valid(curve, n, uneven=uneven)]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCurve:
    """A MetaOp's scaling curve restricted to its valid device counts (0 is the dummy)."""

    metaop: MetaOp
    curve: Curve
    counts: tuple[int, ...]
    """Valid device counts, ascending (`op_curve`), starting with the dummy 0."""
    speedups: tuple[float, ...]
    """T(1) / T(n) at each count (0 at the dummy); non-decreasing for a fitted curve."""
    times_ms: tuple[float, ...]
    """Per-operator time at each count (infinite at the dummy)."""
    envelope: bool = False
    """Whether the allocator works on the counts of the speedups' concave envelope only
    (`on_envelope`): with uneven splits, whose other counts are a staircase below it (B = 32
    on 11 devices runs 3 rows each, a speedup of 10.7 where time-sharing 8 and 16 devices
    gives 11)."""
    _time_by_count: dict[int, float] = field(init=False, repr=False, compare=False)
    """`times_ms` by count (the wave scheduler asks for times at counts very often)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_time_by_count",
                           dict(zip(self.counts, self.times_ms, strict=True)))

    @property
    def work_ms(self) -> float:
        """Single-device time of all operators, L * T(1)."""
        return self.metaop.num_layers * self.single_ms

    @property
    def single_ms(self) -> float:
        """Per-operator time on one device, T(1)."""
        return scaling.time_ms(self.curve, 1)

    def time_at(self, n: int) -> float:
        """Per-operator time at a valid count n."""
        return self._time_by_count[n]

    def on_envelope(self) -> OpCurve:
        """This curve restricted to the counts on the concave envelope of its speedups (those
        on a chord kept): mixing two of them reaches any point of the envelope, so the
        relaxed optimum over them is the level's lower bound."""
        idx = _upper_hull(self.counts, self.speedups)
        return replace(self, counts=tuple(self.counts[i] for i in idx),
                       speedups=tuple(self.speedups[i] for i in idx),
                       times_ms=tuple(self.times_ms[i] for i in idx))

    def faster_count(self, n: int) -> int | None:
        """The smallest valid count above n that runs faster than n by more than MIN_GAIN, or
        None."""
        t = self.time_at(n) * (1 - MIN_GAIN)
        for i in range(bisect_right(self.counts, n), len(self.counts)):
            if self.times_ms[i] < t:
                return self.counts[i]
        return None

    def fewest_within(self, n: float, c_ms: float) -> float:
        """n, or the smallest valid count below it that finishes all operators within
        MIN_GAIN of c_ms (a stretch of the curve that buys nothing)."""
        bar = c_ms * (1 + MIN_GAIN) / self.metaop.num_layers
        for count, t in zip(self.counts[1:], self.times_ms[1:], strict=True):
            if count >= n:
                break
            if t <= bar:
                return float(count)
        return n


def op_curve(metaop: MetaOp, curve: Curve, max_n: int, counts: list[int],
             *, uneven: bool = False) -> OpCurve:
    """Build the restricted curve from the MetaOp's valid counts <= max_n. A count that only
    uneven splits make valid is kept when it runs faster than every smaller count: the others
    are a staircase of equal times (B = 32 runs 2 rows per device on 16 to 31 devices) that
    only hold more devices, where the allocator's interpolated speedup would stall, so the
    bisection overstated C* and the bi-point split and the extension handed out devices that
    buy no time."""
    t1 = scaling.time_ms(curve, 1)
    kept: list[int] = []
    times: list[float] = []
    fastest = math.inf
    for n in counts:
        if n > max_n:
            break
        t = op_time_ms(curve, n, uneven=uneven)
        if t < fastest or _even(curve, n):
            kept.append(n)
            times.append(t)
            fastest = min(fastest, t)
    # a fitted curve is non-increasing; clamp so a noisy fit cannot make speedup decrease
    speedups: list[float] = [0.0]
    for t in times:
        speedups.append(max(speedups[-1], t1 / t if t > 0 else math.inf))
    return OpCurve(metaop=metaop, curve=curve, counts=(0, *kept), speedups=tuple(speedups),
                   times_ms=(math.inf, *times), envelope=uneven)


def _even(curve: Curve, n: int) -> bool:
    """Whether n devices split the batch evenly over their data-parallel groups."""
    return curve.batch_size % (n // tp_degree(scaling.strategy(curve, n))) == 0


@lru_cache(maxsize=4096)
def _upper_hull(counts: tuple[int, ...], speedups: tuple[float, ...]) -> tuple[int, ...]:
    """Indices of the counts on the upper concave envelope of (n, speedup), from (0, 0), with
    the counts that lie on a chord of it."""
    hull: list[int] = []
    for i, (n, s) in enumerate(zip(counts, speedups, strict=True)):
        while len(hull) >= 2:
            (n1, s1), (n2, s2) = ((counts[j], speedups[j]) for j in hull[-2:])
            # drop the middle point when it lies below the chord to (n, s)
            if (s2 - s1) * (n - n1) < (s - s1) * (n2 - n1):
                hull.pop()
            else:
                break
        hull.append(i)
    return tuple(hull)


def _interpolate(counts: tuple[int, ...], s: tuple[float, ...], target: float) -> float:
    """The n at which the speedup, linear between the given counts, reaches `target`."""
    if target > s[-1]:
        return math.inf
    i = bisect_right(s, target)
    if i >= len(s):
        return float(counts[-1])
    lo, hi = i - 1, i
    n_lo, n_hi = counts[lo], counts[hi]
    return n_lo + (n_hi - n_lo) * (target - s[lo]) / (s[hi] - s[lo])


def _envelope_need(oc: OpCurve) -> Callable[[float], float]:
    """Like `n_lin`, but along the upper concave envelope of the speedups, as a function of C
    (the envelope and the work computed once, for the bisection's many evaluations): mixing
    the two envelope counts around a point (time-sharing, as the bi-point split does) reaches
    it, so the relaxed optimum on the envelope is a lower bound for any schedule on valid
    counts. It equals `n_lin` when speedups are concave; a strategy switch that is
    superlinear between valid counts (the paper's own worked example has one) makes it
    smaller."""
    idx = _upper_hull(oc.counts, oc.speedups)
    counts = tuple(oc.counts[i] for i in idx)
    speedups = tuple(oc.speedups[i] for i in idx)
    work_ms = oc.work_ms
    return lambda c_ms: _interpolate(counts, speedups, work_ms / c_ms)


def _lin_need(oc: OpCurve) -> Callable[[float], float]:
    """`n_lin` of one MetaOp as a function of C (the work computed once)."""
    counts, speedups, work_ms = oc.counts, oc.speedups, oc.work_ms
    return lambda c_ms: _interpolate(counts, speedups, work_ms / c_ms)


def n_lin(oc: OpCurve, c_ms: float) -> float:
    """Devices the MetaOp needs to finish all operators by c_ms, on the interpolated speedup
    curve; infinite when even its largest valid count is too slow."""
    return _lin_need(oc)(c_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class AslTuple:
    """An ASL-tuple: `num_ops` operators of a MetaOp on `n` devices (start set by the waves)."""

    metaop: str
    n: int
    num_ops: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OpAllocation:
    """One MetaOp's share of the level: n*, its two tuples before and after rounding."""

    metaop: str
    n_star: float
    n_lo: int
    n_hi: int
    ops_lo: float
    """Operators on n_lo before rounding (0 for a dummy)."""
    ops_hi: float
    """Operators on n_hi before rounding."""
    tuples: tuple[AslTuple, ...]
    """Rounded tuples with at least one operator, upper tuple first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelAllocation:
    """The relaxed optimum of one level and its discretization."""

    level: int
    c_star_ms: float
    lower_bound_ms: float
    """`lower_bound_ms(...)`: C* on the concave speedup envelope (= C* for concave curves)."""
    ops: tuple[OpAllocation, ...]


def _bisect_makespan(curves: list[OpCurve], num_devices: int,
                     need: Callable[[OpCurve], Callable[[float], float]]) -> float:
    """The smallest C with sum_m need(m)(C) <= N, by bisection on
    [max L * T(inf), sum L * T(1)] (eq. 9; the left side is non-increasing in C). `need(m)`
    returns MetaOp m's device count as a function of C. T(inf), the last piece's alpha, is
    no bound where a valid count runs faster (a later piece with more fixed cost, or a batch
    that ends the counts early): there the fastest valid count's time is the lower end."""
    lo = max(0.0, max(oc.metaop.num_layers * min(scaling.floor_ms(oc.curve), min(oc.times_ms))
                      for oc in curves))
    hi = math.fsum(oc.work_ms for oc in curves)
    needs = [need(oc) for oc in curves]
    # C* at the slowest MetaOp's time on its fastest count, where no C below it is feasible
    # (a need that is infinite past the last count) and it leaves devices over: bisection
    # would only close in on it, leaving that MetaOp's n* a hair below its count. The next
    # float up absorbs the division's rounding.
    reach = max((oc.work_ms / oc.speedups[-1] for oc in curves if oc.speedups[-1] > 0),
                default=0.0)
    if 0 < reach and lo <= reach and _exceeds(needs, math.nextafter(reach, 0.0), num_devices):
        for c_ms in (reach, math.nextafter(reach, math.inf)):
            if c_ms <= hi and not _exceeds(needs, c_ms, num_devices):
                return c_ms
    for _ in range(_BISECTION_STEPS):
        if hi - lo <= _REL_TOL * hi:
            break
        mid = (lo + hi) / 2
        if mid <= 0:
            lo = mid
            continue
        if _exceeds(needs, mid, num_devices):
            lo = mid
        else:
            hi = mid
    return hi


def _exceeds(needs: list[Callable[[float], float]], c_ms: float, num_devices: int) -> bool:
    """Whether sum_m needs[m](c_ms) > N. The terms are non-negative, so a partial sum past N
    decides it (the same answer as the whole sum, which only grows)."""
    total = 0.0
    for f in needs:
        total += f(c_ms)
        if total > num_devices:
            return True
    return False


def relaxed_optimum_ms(curves: list[OpCurve], num_devices: int) -> float:
    """C*: the smallest C with sum_m n_lin_m(C) <= N."""
    return _bisect_makespan(curves, num_devices, _lin_need)


def lower_bound_ms(curves: list[OpCurve], num_devices: int) -> float:
    """The relaxed optimum on the speedup envelope (`_envelope_need`): a lower bound for the level
    under any planner that runs it between barriers; equal to C* when every speedup curve is
    concave. Schedules that overlap levels (`schedules.fused_waves`, the optimus and distmm
    baselines) are not bounded by the sum over levels."""
    return _bisect_makespan(curves, num_devices, _envelope_need)


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def split(oc: OpCurve, n_star: float, c_ms: float) -> OpAllocation:
    """The bi-point discretization of one MetaOp at n* (time-split form, then rounding)."""
    num_layers = oc.metaop.num_layers
    i = bisect_right(oc.counts, n_star - 1e-9)
    i = min(max(i, 1), len(oc.counts) - 1)
    n_hi, n_lo = oc.counts[i], oc.counts[i - 1]
    if abs(n_star - n_hi) <= 1e-9 * max(1.0, n_star):
        n_lo = n_hi
    if n_hi == n_lo:
        ops_hi, ops_lo = float(num_layers), 0.0
    else:
        frac = min(max((n_star - n_lo) / (n_hi - n_lo), 0.0), 1.0)
        ops_hi = frac * c_ms / oc.time_at(n_hi)
        ops_lo = 0.0 if n_lo == 0 else (1 - frac) * c_ms / oc.time_at(n_lo)
    hi_r, lo_r = _round_half_up(ops_hi), _round_half_up(ops_lo)
    residual = num_layers - hi_r - lo_r
    # the public code's rule: the residual goes to the lower tuple when it is real and
    # non-empty, otherwise to the upper one; rounding keeps sum = L exactly
    if n_lo > 0 and lo_r > 0:
        lo_r += residual
    else:
        hi_r += residual
    if lo_r < 0:
        hi_r, lo_r = hi_r + lo_r, 0
    if hi_r < 0:
        hi_r, lo_r = 0, lo_r + hi_r
    tuples = [AslTuple(metaop=oc.metaop.id, n=n_hi, num_ops=hi_r)]
    if n_lo > 0:
        tuples.append(AslTuple(metaop=oc.metaop.id, n=n_lo, num_ops=lo_r))
    return OpAllocation(
        metaop=oc.metaop.id, n_star=n_star, n_lo=n_lo, n_hi=n_hi, ops_lo=ops_lo, ops_hi=ops_hi,
        tuples=tuple(t for t in tuples if t.num_ops > 0),
    )


def allocate_level(level: int, curves: list[OpCurve], num_devices: int, *,
                   spread: bool = False) -> LevelAllocation:
    """C* of the level and the bi-point tuples of each of its MetaOps (in input order), on
    each curve's envelope counts where it asks for them (`OpCurve.envelope`). When C* is the
    time of a MetaOp that more devices barely speed up, the relaxed optimum gives it every
    device the others leave over (sum n* = N); it gets the fewest that finish within MIN_GAIN
    of C* instead (`OpCurve.fewest_within`), unless `spread`: on more devices its memory is
    spread (and sharded by ZeRO) and its rows may stay where its consumer runs, on fewer it
    has no gradient sync; the planner tries both (`api.make_plan`)."""
    curves = [oc.on_envelope() if oc.envelope else oc for oc in curves]
    c_star = relaxed_optimum_ms(curves, num_devices)
    ops = []
    for oc in curves:
        n_star = min(n_lin(oc, c_star), float(oc.counts[-1]))
        if not spread:
            n_star = oc.fewest_within(n_star, c_star)
        ops.append(split(oc, n_star, c_star))
    # concave speedups are their own envelope: the bound's bisection would repeat C*'s
    concave = all(len(_upper_hull(oc.counts, oc.speedups)) == len(oc.counts) for oc in curves)
    return LevelAllocation(
        level=level, c_star_ms=c_star,
        lower_bound_ms=c_star if concave else lower_bound_ms(curves, num_devices),
        ops=tuple(ops))


def single_count(alloc: LevelAllocation) -> LevelAllocation:
    """`alloc` with each MetaOp's operators all on one count: the tuple holding most of them
    (the larger count on ties). A MetaOp then keeps one device count through the level, so its
    rows are never re-split between its own slices: slower compute than the bi-point split,
    less inter-wave traffic (the planner's simulator decides, `api.make_plan`)."""
    ops = []
    for a in alloc.ops:
        keep = max(a.tuples, key=lambda t: (t.num_ops, t.n))
        total = sum(t.num_ops for t in a.tuples)
        ops.append(replace(a, tuples=(AslTuple(metaop=a.metaop, n=keep.n, num_ops=total),)))
    return replace(alloc, ops=tuple(ops))


def analytic_optimum_ms(curves: list[OpCurve], num_devices: int) -> float:
    """The C at which the MetaOps' continuous counts on the fitted curves, n_m = T_m^-1(C / L_m)
    (`scaling.inverse_n`, capped at the largest valid count), sum to N."""
    def need(oc: OpCurve) -> Callable[[float], float]:
        return lambda c: min(scaling.inverse_n(oc.curve, c / oc.metaop.num_layers),
                             oc.counts[-1])

    return _bisect_makespan(curves, num_devices, need)


def allocate_level_analytic(level: int, curves: list[OpCurve],
                            num_devices: int) -> LevelAllocation:
    """The paper's form of the bi-point split (eqs. 8-10): n*_m from the fitted curve's inverse
    at the analytic optimum C (`analytic_optimum_ms`), then, on the valid counts
    n_lo <= n* <= n_hi, l-bar = (T(n_lo) L - C) / (T(n_lo) - T(n_hi)) rounded to the nearest
    integer in [0, L] and l = L - l-bar (all L on n_hi for a dummy n_lo = 0). Unlike
    `allocate_level`, the area N * C is only approximately conserved. `c_star_ms` stays the
    interpolated C* of `relaxed_optimum_ms`, the bound plans are measured against."""
    c_ms = analytic_optimum_ms(curves, num_devices)
    ops = []
    for oc in curves:
        num_layers = oc.metaop.num_layers
        n_star = min(scaling.inverse_n(oc.curve, c_ms / num_layers), float(oc.counts[-1]))
        i = bisect_right(oc.counts, n_star - 1e-9)
        i = min(max(i, 1), len(oc.counts) - 1)
        n_hi, n_lo = oc.counts[i], oc.counts[i - 1]
        t_hi, t_lo = oc.time_at(n_hi), oc.time_at(n_lo)
        if n_lo == 0 or abs(n_star - n_hi) <= 1e-9 * max(1.0, n_star):
            ops_hi, ops_lo = float(num_layers), 0.0
        elif t_lo <= t_hi:  # a flat stretch: the smaller count is as fast
            ops_hi, ops_lo = 0.0, float(num_layers)
        else:
            ops_hi = min(max((t_lo * num_layers - c_ms) / (t_lo - t_hi), 0.0), num_layers)
            ops_lo = num_layers - ops_hi
        hi_r = min(max(_round_half_up(ops_hi), 0), num_layers)
        tuples = [AslTuple(metaop=oc.metaop.id, n=n_hi, num_ops=hi_r)]
        if n_lo > 0:
            tuples.append(AslTuple(metaop=oc.metaop.id, n=n_lo, num_ops=num_layers - hi_r))
        ops.append(OpAllocation(
            metaop=oc.metaop.id, n_star=n_star, n_lo=n_lo, n_hi=n_hi, ops_lo=ops_lo,
            ops_hi=ops_hi, tuples=tuple(t for t in tuples if t.num_ops > 0)))
    return LevelAllocation(level=level, c_star_ms=relaxed_optimum_ms(curves, num_devices),
                           lower_bound_ms=lower_bound_ms(curves, num_devices), ops=tuple(ops))
