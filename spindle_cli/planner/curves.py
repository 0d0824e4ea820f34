"""Piecewise alpha-beta fitting of scaling curves (paper section 3.2).

Input: the best feasible time per profiled device count of one operator signature. Output:
contiguous `CurvePiece`s with T(n) = alpha + beta * B / n, evaluated by
`spindle_cli.planner.scaling`.

How the fit works:
- Only counts that help are fitted: the fit stops before the first count that is slower than
  the fastest count before it by more than `noise_rel` (beyond the batch size tensor
  parallelism is often slower than data parallelism at fewer devices). Analytic points have
  no noise (`noise_rel` 0: any slowdown ends the run). Measured points do
  (`MEASURED_NOISE_REL`): sub-millisecond operators scatter by a few percent from one median
  to the next, and cutting the curve there would forbid counts that merely do not help. A
  count within the tolerance is fitted at the best time before it (the curve stays flat: no
  speedup is claimed that was not seen), and `max_rel_error` reports its distance from the
  measured time. The pieces then end at the last helpful count, so
  `scaling.count_range` closes there and the planner never allocates devices that do not
  help; the slower points stay in the profile. A running minimum would instead claim, at the
  larger count, a time that no strategy achieves there.
- Between consecutive counts n_i < n_{i+1} the piece passes exactly through both points (two
  equations, two unknowns in b = B / n), so the fit is exact at every fitted count. The times
  never increase with n, so beta >= 0 holds without clamping; the clamp below guards rounding.
- A count that does not split the batch evenly is placed where its per-device work belongs
  (`_knots`): B = 96 on 64 devices runs 2 samples per device, the work of 48 devices.
- A kink inside a segment (the roofline's switch from weight-memory-bound to compute-bound
  falls between two counts) makes the chord overestimate the time there. When the segment
  before and the one after run the same strategy and the slopes fall strictly from one
  segment to the next (convex), the neighbours' lines are extended into the segment and meet
  at the kink n*; pieces break at floor(n*) and ceil(n*) so every integer count lies on one of
  the two lines (a one-count chord bridges them, keeping T continuous). Each strategy's
  roofline time is the maximum of two lines in b, so this is exact for the analytic source.
- Piece k covers (n_k, n_{k+1}] and carries the strategy of its right end, because
  `scaling.strategy(curve, n)` picks the first piece with n <= n_hi. When the first count uses
  another strategy than the first piece, a zero-width piece [n_0, n_0] carries it.
- The last piece extends to n -> infinity, so its alpha is the floor. A superlinear last
  segment would have alpha < 0 and predict negative times far out; then a zero-width tail
  piece [n_last, n_last] with alpha = 0 extrapolates by ideal (linear) scaling instead.
- One count alone gives a flat piece (beta = 0): no scaling is assumed that was not seen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spindle_cli.artifacts.profile import Curve, CurvePiece, MemoryModel, ProfilePoint
from spindle_cli.planner import scaling

MEASURED_NOISE_REL = 0.10
"""Tolerance for measured profiles: a count counts as slower than the best earlier count only
beyond this relative margin. Measured on this repository's CPU ranks (8 medians of 20 repeats
per tiny-clip operator at 8 and 4 rows, one thread, other processes running): the medians'
relative standard deviation was 0.4% to 5.6% (typically 2-3%) and single medians strayed up
to +14%. Two medians then differ by about sqrt(2) x 3.5% ~ 5% (one sigma); 10% is two of
those sigmas."""

KINK_SLOPE_REL = 1e-6
"""Relative slope drop that counts as a kink (below it the lines are parallel up to rounding,
and their intersection is meaningless)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """The best feasible time at one device count."""

    num_devices: int
    time_ms: float
    strategy: str
    work_devices: float = 0.0
    """The count whose B / n matches the per-device batch actually run (ceil(B / groups) per
    group): differs from num_devices when n does not divide B; 0 means num_devices."""

    @property
    def compare_at(self) -> float:
        """Where the curve is compared with this sample."""
        return self.work_devices or self.num_devices


def helpful_run(samples: Sequence[Sample], noise_rel: float = 0.0) -> list[Sample]:
    """Samples sorted by count, up to (excluding) the first one slower than the fastest one
    before it by more than `noise_rel` (relative)."""
    out: list[Sample] = []
    best_ms = math.inf
    for s in sorted(samples, key=lambda s: s.num_devices):
        if s.time_ms > best_ms * (1.0 + noise_rel):
            break
        out.append(s)
        best_ms = min(best_ms, s.time_ms)
    return out


def _no_slower(run: Sequence[Sample]) -> list[Sample]:
    """The run with each time capped at the best time before it: a count within the noise of
    an earlier, faster one is fitted as no faster than it (times never increase with n)."""
    out: list[Sample] = []
    for s in run:
        out.append(s if not out or s.time_ms <= out[-1].time_ms
                   else replace(s, time_ms=out[-1].time_ms))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Line:
    """T = alpha + beta * b, b = B / n."""

    alpha: float
    beta: float

    def at(self, b: float) -> float:
        return self.alpha + self.beta * b


def _through(batch_size: int, lo: Sample, hi: Sample) -> _Line:
    """The line in b = B / n through two samples, each where its work belongs
    (`Sample.compare_at`)."""
    b_lo = batch_size / lo.compare_at
    b_hi = batch_size / hi.compare_at
    # two knots of one work (a flat piece, `_knots`) are one point: no slope
    beta = max(0.0, (lo.time_ms - hi.time_ms) / (b_lo - b_hi)) if b_lo != b_hi else 0.0
    return _Line(alpha=hi.time_ms - beta * b_hi, beta=beta)


def _piece(n_lo: int, n_hi: int, line: _Line, strategy: str) -> CurvePiece:
    return CurvePiece(n_lo=n_lo, n_hi=n_hi, alpha_ms=line.alpha, beta_ms=line.beta,
                      strategy=strategy)


def _kinked(batch_size: int, lo: Sample, hi: Sample, before: _Line, after: _Line,
            strategy: str) -> list[CurvePiece]:
    """Pieces over [lo, hi] along `before` up to the kink and `after` beyond it (see the
    module docstring); the caller has checked that the slopes fall strictly."""
    b_kink = (after.alpha - before.alpha) / (before.beta - after.beta)
    n_kink = batch_size / b_kink
    left, right = math.floor(n_kink), math.ceil(n_kink)
    left = min(max(left, lo.num_devices), hi.num_devices)
    right = min(max(right, left), hi.num_devices)
    pieces = []
    if left > lo.num_devices:
        pieces.append(_piece(lo.num_devices, left, before, strategy))
    if right > left:
        bridge = _through(
            batch_size,
            Sample(num_devices=left, time_ms=before.at(batch_size / left), strategy=strategy),
            Sample(num_devices=right, time_ms=after.at(batch_size / right), strategy=strategy),
        )
        pieces.append(_piece(left, right, bridge, strategy))
    if hi.num_devices > right:
        pieces.append(_piece(right, hi.num_devices, after, strategy))
    return pieces


def _is_kink(lines: list[_Line], k: int) -> bool:
    """Whether segment k lies between two segments whose lines make it convex."""
    if k == 0 or k + 1 >= len(lines):
        return False
    b0, b1, b2 = lines[k - 1].beta, lines[k].beta, lines[k + 1].beta
    # a flat neighbour is a plateau of one per-device batch (`_knots`), not a roofline regime
    flat = b2 == 0.0
    return not flat and b0 - b1 > KINK_SLOPE_REL * b0 and b1 - b2 > KINK_SLOPE_REL * b0


def _knots(run: Sequence[Sample]) -> list[Sample]:
    """The points the pieces pass through. A count n that does not split the batch evenly
    really ran the per-device work of a smaller count x (`Sample.work_devices`); where there is
    room above the previous knot, the line reaches T at x, where that work belongs, and T stays
    flat up to n (every count in between runs the same per-device batch): knots (x, T) and
    (n, T). Where x is no whole count (B = 80 on 32 devices runs 3 rows each, the work of
    26.67) its knot bounds the pieces at floor(x) and places the line at x (`work_devices`):
    the line, still falling at floor(x), meets the flat T at x, so T never rises with n, and
    `scaling.work_count` reads x on the flat piece, and the line beyond n starts from x too.
    Without room (floor(x) at or below the previous knot, or at n), or for the first count's
    fractional work, n's knot stays at n."""
    out: list[Sample] = []
    for s in run:
        x = s.work_devices
        above = out[-1].num_devices if out else 0
        whole = abs(x - round(x)) < 1e-9
        at = round(x) if whole else math.floor(x)
        placed = 0.0
        # a first count's fractional work has no line to meet: below it the first piece would
        # claim its time for fewer devices
        if x and above < at < s.num_devices and (whole or out):
            placed = 0.0 if whole else x
            out.append(Sample(num_devices=at, time_ms=s.time_ms, strategy=s.strategy,
                              work_devices=placed))
        # the flat piece's end: the line beyond starts from where the work is, too
        out.append(Sample(num_devices=s.num_devices, time_ms=s.time_ms, strategy=s.strategy,
                          work_devices=placed))
    return out


def fit_pieces(samples: Sequence[Sample], batch_size: int, *,
               noise_rel: float = 0.0) -> tuple[CurvePiece, ...]:
    """Fit contiguous pieces through the helpful run of the samples; see the module
    docstring."""
    if not samples:
        raise ValueError("cannot fit a curve without a feasible sample")
    counts = [s.num_devices for s in samples]
    if len(set(counts)) != len(counts):
        raise ValueError(f"duplicate device counts in {counts}")
    knots = _knots(_no_slower(helpful_run(samples, noise_rel)))
    if len(knots) == 1:
        (s,) = knots
        return (_piece(s.num_devices, s.num_devices, _Line(alpha=s.time_ms, beta=0.0),
                       s.strategy),)
    lines = [_through(batch_size, lo, hi) for lo, hi in zip(knots, knots[1:], strict=False)]
    pieces: list[CurvePiece] = []
    for k, line in enumerate(lines):
        lo, hi = knots[k], knots[k + 1]
        same = {s.strategy for s in knots[max(k - 1, 0):k + 3]} == {hi.strategy}
        if same and _is_kink(lines, k):
            pieces.extend(_kinked(batch_size, lo, hi, lines[k - 1], lines[k + 1], hi.strategy))
        else:
            pieces.append(_piece(lo.num_devices, hi.num_devices, line, hi.strategy))
    first = knots[0]
    if first.strategy != pieces[0].strategy:
        head = pieces[0]
        pieces.insert(0, CurvePiece(n_lo=first.num_devices, n_hi=first.num_devices,
                                    alpha_ms=head.alpha_ms, beta_ms=head.beta_ms,
                                    strategy=first.strategy))
    last = knots[-1]
    if pieces[-1].alpha_ms < 0:
        ideal = _Line(alpha=0.0, beta=last.time_ms * last.num_devices / batch_size)
        pieces.append(_piece(last.num_devices, last.num_devices, ideal, last.strategy))
    return tuple(pieces)


def max_rel_error(curve: Curve, samples: Sequence[Sample]) -> float:
    """Largest |T_curve(n) - T(n)| / T(n) over the samples (0 for none), each compared at the
    per-device batch it ran with (`Sample.compare_at`)."""
    worst = 0.0
    for s in samples:
        predicted = scaling.time_ms(curve, s.compare_at)
        worst = max(worst, abs(predicted - s.time_ms) / s.time_ms)
    return worst


def fit_curve(
    *,
    signature: str,
    batch_size: int,
    samples: Sequence[Sample],
    points: tuple[ProfilePoint, ...],
    memory: MemoryModel,
    noise_rel: float = 0.0,
    flat: bool = False,
) -> Curve:
    """The fitted Curve of one signature: pieces from `samples` (best feasible time per fitted
    count) and the fit error at the samples the pieces cover (the helpful run). With `flat`
    (every sample ran the same work, so their times differ by noise only) the pieces give
    every count the samples' median time. Held-out validation is added by `profiling` (it
    needs the raw points of the curve's strategy)."""
    fit_from = list(samples)
    if flat:
        typical_ms = statistics.median(s.time_ms for s in samples)
        fit_from = [replace(s, time_ms=typical_ms) for s in samples]
    pieces = fit_pieces(fit_from, batch_size, noise_rel=noise_rel)
    draft = Curve(
        signature=signature,
        batch_size=batch_size,
        points=points,
        pieces=pieces,
        memory=memory,
        max_rel_error=0.0,
    )
    # compared where the planner asks for a fitted count: at n itself (a count placed at its
    # work, `_knots`, is exact there by construction)
    covered = {s.num_devices for s in helpful_run(fit_from, noise_rel)}
    fitted = [replace(s, work_devices=0.0) for s in samples if s.num_devices in covered]
    return Curve(
        signature=signature,
        batch_size=batch_size,
        points=points,
        pieces=pieces,
        memory=memory,
        max_rel_error=max_rel_error(draft, fitted),
    )
